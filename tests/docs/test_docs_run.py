"""Every Python block of README.md and docs/*.md runs, as written, against tiny local checkpoints.

Each block is a program of its own: it runs in a fresh namespace, so an example that forgets an import or reads a
name it never defines fails here as it would for a reader who copies it. A block that builds on the one before it
says so in its first line, ``# (continues the example above)``, and is run joined to it: in the namespace the
blocks it continues left, right after them. A page whose examples read a ``path`` they do not define says so in
its text, in the sentence "In the examples of this page, `path` is a checkpoint directory or hub id, such as
`"<hub id>"`."; each of its blocks then starts with ``path`` bound to the tiny checkpoint of that hub id.

Hub repository ids in the text are replaced by tiny local checkpoints of the same architecture, written by stock
``save_pretrained`` (``HUB_IDS``; the tiny checkpoint of Llama-3.2-1B ties its head to its embeddings, as the real one
does). Blocks run in a temporary working directory, one page after another; nothing touches a network. No block
is skipped: the blocks written for ``torchrun`` say how they run as one plain process (unsharded), and run so here.
"""

from __future__ import annotations

import importlib
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelpatch.modes.quantization import quantizer_api_supported

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Hub ids the docs use -> the tiny checkpoint standing in for them.
HUB_IDS = {
    "meta-llama/Llama-3.2-1B": "llama_tied",
    "Qwen/Qwen1.5-MoE-A2.7B": "qwen2_moe",
    "Qwen/Qwen3-30B-A3B": "qwen3_moe",
}
CONTINUES = "# (continues the example above)"
# The sentence, wrapped anywhere.
_PATH_SENTENCE = re.compile(
    r"\s+".join("In the examples of this page, `path` is a checkpoint directory or hub id, such as".split())
    + r'\s+`"([^"`]+)"`\.'
)
_FENCE = re.compile(r"^\s*```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its source and the line of the page it starts on (1-based)."""

    language: str
    source: str
    line: int


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, indented ones (inside list items) included."""
    blocks = []
    opened: tuple[str, int] | None = None
    lines: list[str] = []
    for number, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        fence = _FENCE.match(text)
        if opened is None:
            if fence:
                opened, lines = (fence.group(1), number + 1), []
        elif fence and not fence.group(1):
            blocks.append(Block(opened[0], textwrap.dedent("\n".join(lines)) + "\n", opened[1]))
            opened = None
        else:
            lines.append(text)
    assert opened is None, f"{page.name}: the block opened on line {opened[1] - 1} is never closed"
    return blocks


def programs(page: Path) -> list[list[Block]]:
    """The page's Python blocks, each continuation joined to the blocks it continues."""
    joined: list[list[Block]] = []
    for block in (b for b in code_blocks(page) if b.language == "python"):
        if block.source.startswith(CONTINUES):
            assert joined, f"{page.name}, line {block.line}: a block that continues none before it"
            joined[-1].append(block)
        else:
            joined.append([block])
    return joined


def page_path(page: Path) -> str | None:
    """The hub id the page says its examples' ``path`` stands for, if it says so."""
    found = _PATH_SENTENCE.search(page.read_text(encoding="utf-8"))
    return found.group(1) if found else None


def with_tiny_checkpoints(source: str, tiny) -> str:
    """``source`` with each hub id it names replaced by the path of its tiny checkpoint (built on first use)."""
    for hub_id, name in HUB_IDS.items():
        if f'"{hub_id}"' in source:
            source = source.replace(f'"{hub_id}"', repr(str(tiny(name).path)))
    return source


PAGES_WITH_CODE = [page for page in PAGES if programs(page)]


# Tools a docs example may use that a supported set cannot install (llm-compressor needs compressed-tensors >= 0.20,
# which the lowest set's torch cannot run): an example importing one that does not import here is skipped by name.
OPTIONAL_TOOLS = ("llmcompressor",)
PROGRAMS = [(page, index) for page in PAGES_WITH_CODE for index in range(len(programs(page)))]


def _missing_tool(program: list[Block]) -> str | None:
    for tool in OPTIONAL_TOOLS:
        if any(re.search(rf"^\s*(from|import) {tool}\b", block.source, re.M) for block in program):
            try:
                importlib.import_module(tool)
            except ImportError as exc:
                return f"{tool} does not import here ({exc})"
    # A quantized load needs transformers' quantizer API of 5.23 (the lowest set's 5.15 is refused by name).
    if any("quantization_config=" in block.source for block in program) and not quantizer_api_supported():
        import transformers

        return f"transformers {transformers.__version__}'s quantizer API predates 5.23's: quantized loads are refused"
    return None


@pytest.mark.parametrize(("page", "index"), PROGRAMS, ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_python_blocks_run(page, index, tiny, tmp_path, monkeypatch):
    """Each example program of a page (a block, with the blocks that continue it) runs alone, in a fresh namespace."""
    program = programs(page)[index]
    missing = _missing_tool(program)
    if missing is not None:
        pytest.skip(f"{page.name}, line {program[0].line}: {missing}")
    monkeypatch.chdir(tmp_path)
    hub_id = page_path(page)
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    if hub_id is not None:
        namespace["path"] = str(tiny(HUB_IDS[hub_id]).path)
    for block in program:
        # Blank lines in front, so that a traceback names the page's own line numbers.
        source = "\n" * (block.line - 1) + with_tiny_checkpoints(block.source, tiny)
        exec(compile(source, str(page.relative_to(ROOT)), "exec"), namespace)  # noqa: S102


def test_every_block_is_checked():
    """Every fence names its language, and only Python blocks are code: none is left out silently."""
    for page in PAGES:
        for block in code_blocks(page):
            where = f"{page.name}, line {block.line}"
            assert block.language in {"python", "bash", "text", "console", ""}, f"{where}: fence ```{block.language}"
            if block.language != "python":
                assert not re.match(r"\s*(import |from \w+ import )", block.source), f"{where}: Python not run"


def test_hub_ids_and_path_have_tiny_checkpoints():
    """Each hub id (``"owner/name"``) a Python block names, and each page's ``path``, has a tiny checkpoint."""
    for page in PAGES_WITH_CODE:
        assert page_path(page) in {None, *HUB_IDS}, f"{page.name}: path stands for {page_path(page)}"
        for program in programs(page):
            for block in program:
                for repo_id in re.findall(r'"([\w.-]+/[\w.-]+)"', block.source):
                    if re.search(r"\.(safetensors|json|bin|py)$", repo_id):
                        continue  # a file path, not a repository
                    assert repo_id in HUB_IDS, f"{page.name}, line {block.line}: no tiny checkpoint for {repo_id}"
