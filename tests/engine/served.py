"""``SERVED``: the engine configuration `agentrt serve` runs by default on this machine.

That is dtype auto (bfloat16 where the CPU has native bf16 dot products, float32 elsewhere) and the weight path
measured fastest here (engine/config.py). Tests whose assertions do not depend on float32 numerics (output forced by
a grammar, or only parsed and validated) run on it: it is the path a server's users get, and a step costs a third
to a fifth of one on the float32 dense reference path the engine library defaults to (measured on a 2-core Xeon,
a batch of 8: 21.9 against 68.6 ms). Tests that compare two engines token for token, or an engine with
transformers, stay on float32.
"""

SERVED = dict(dtype="auto")
