"""`python -m engine.bench ...`: the same as `deepseek-engine bench ...`."""

import argparse
import shlex
import sys

from engine.bench.cli import add_bench_args, run_bench

parser = argparse.ArgumentParser(prog="python -m engine.bench", description="benchmark the engine against the hardware")
add_bench_args(parser)
sys.exit(run_bench(parser.parse_args(), "python -m engine.bench " + shlex.join(sys.argv[1:])))
