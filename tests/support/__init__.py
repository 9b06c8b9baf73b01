"""What the tests share, in one place (``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` option).

* :mod:`support.models`: the tiny-model table, model type -> tiny config builder, and text configs of given sizes;
* :mod:`support.checkpoints`: the checkpoint factory: tiny checkpoints written by stock ``save_pretrained``, once per
  session, with the inputs and the stock reference outputs to compare against;
* :mod:`support.compiled`: transformers' compiled generation (static cache) and what dynamo made of it;
* :mod:`support.compare`: bitwise comparisons (state dicts, tensors, checkpoint files) and output comparisons;
* :mod:`support.files`: reading, rewriting and snapshotting checkpoint directories;
* :mod:`support.fusions`: what every fusion family must show (fused outputs, exact saves, runtime round trip);
* :mod:`support.patching`: tiny patching configs, the replacement classes of the class-patching tests, and builds of a
  model with and without a patch mapping;
* :mod:`support.threads`: running a function on several threads at once;
* :mod:`support.zoo`: the zoo sweep (``benchmarks/zoo.py``): tiny configs of every model type, its in-process checks.
"""
