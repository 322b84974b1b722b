"""The benchmarks: one module per benchmark, run by `python -m benches NAME` (benches/__main__.py;
`pdm run bench-NAME` is that command), on the harness in benches/harness/. Results, committed,
are in benches/results/ and the traces they replay in benches/traces/."""
