"""The harness every benchmark in benches/ runs on: `python -m benches NAME` (benches/__main__.py)
is the one entry point, which sets up Ctrl-C and loads MLX before the benchmark's module.

- models:   the model a benchmark runs, built in any process (`BenchModel`);
- cli:      the command line they share (model, output paths, --repeats);
- errors:   an error of the solution or of the bench's checks, in one line (`OneLineErrors`);
- machine:  host, MLX and BLAS, of this process and of the runs it starts;
- runs:     runs in fresh processes, in an order that alternates;
- ranks:    runs on several ranks under mlx.launch, and a rank's group;
- server:   a server in a process of its own on a loopback port, and clients started together;
- stats:    percentiles and medians over repeated runs;
- progress: lines on stderr, and where the runs stand;
- report:   the JSON (one schema: host, settings, runs, summary, targets), plots and tables.
"""

from benches.harness.cli import *  # noqa: F403
from benches.harness.errors import *  # noqa: F403
from benches.harness.machine import *  # noqa: F403
from benches.harness.models import *  # noqa: F403
from benches.harness.progress import *  # noqa: F403
from benches.harness.ranks import *  # noqa: F403
from benches.harness.report import *  # noqa: F403
from benches.harness.runs import *  # noqa: F403
from benches.harness.server import *  # noqa: F403
from benches.harness.stats import *  # noqa: F403
