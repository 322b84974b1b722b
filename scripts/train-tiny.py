"""Train the tiny chat model that `--model tiny` serves: `pdm run train-tiny [--help]`.

Reads the committed corpus (data/tiny-chat/corpus.jsonl) and writes the checkpoint, its
training log and summary into src/tiny_llm_support/tiny_chat/. See
tiny_llm_support/train_tiny.py and the book's appendix on the tiny model. Ctrl-C or SIGTERM
stop it with one line and leave the checkpoint and its log as they were.
"""

import os
import sys

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from tiny_llm_support import reexec_with_openblas
from tiny_llm_support.train_tiny import main

if __name__ == "__main__":
    # OpenBLAS splits a matmul differently for another thread count, which changes the last
    # bits of the weights: the same count everywhere keeps a rerun identical.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
    reexec_with_openblas()
    sys.exit(startup.run(main))
