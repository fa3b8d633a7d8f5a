"""Command line of the engine.

    python serve.py demo [--shape 6|35|interleaved]   # the multi-agent demo, stateful vs stateless
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="agentkv: a stateful inference engine for multi-agent tool calling")
    parser.add_argument("command", choices=["demo"], help="demo: run a multi-agent workflow, stateful vs stateless")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "demo":
        from experiments.demo import main as demo

        demo(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
