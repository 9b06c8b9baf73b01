"""Every Python block of README.md and docs/*.md runs, as written, against tiny local checkpoints.

The blocks of one page run in order in one namespace (a page builds on its earlier blocks), in a temporary working
directory. Hub repository ids in the text are replaced by local checkpoints of the same model type, written by stock
``save_pretrained``; ``path`` is predefined as such a Llama checkpoint (grouped-query attention) for pages that say
"``path``: a checkpoint directory or hub id". Nothing touches a network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Hub ids the docs use -> the tiny checkpoint standing in for them.
HUB_IDS = {
    "meta-llama/Llama-3.2-1B": "llama",
    "Qwen/Qwen1.5-MoE-A2.7B": "qwen2_moe",
    "Qwen/Qwen3-30B-A3B": "qwen3_moe",
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
}
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return _BLOCK.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}", "path": str(tiny("llama").path)}
    for index, block in enumerate(python_blocks(page)):
        for hub_id, name in HUB_IDS.items():
            block = block.replace(repr(hub_id).replace("'", '"'), repr(str(tiny(name).path)))
        exec(compile(block, f"{page.name}, python block {index + 1}", "exec"), namespace)  # noqa: S102


def test_every_page_with_code_is_checked():
    """A page whose examples are not Python (shell, text) says so in its fence, so none is skipped silently."""
    for page in PAGES:
        for fence in re.findall(r"^```(\w*)$", page.read_text(encoding="utf-8"), re.M):
            assert fence in {"python", "bash", "text", "console", ""}, f"{page.name}: fence ```{fence}"
