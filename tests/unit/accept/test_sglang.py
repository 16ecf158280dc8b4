"""The SGLang command lines eyrie writes, parsed with the option table of the release the image pins.

The table (tests/fixtures/sglang/) was read from that release's own ``server_args.py``
by ``tests/fixtures/sglang/extract_flags.py``; a test below keeps it the image's version.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest
import yaml

from eyrie_testing import REPO
from pipeline.steps.sglang import Speculation, server_argv

SGLANG_DOCKERFILE = REPO / "images" / "sglang" / "Dockerfile"
TABLES = REPO / "tests" / "fixtures" / "sglang"
TYPES = {"int": int, "float": float}


def pinned_version() -> str:
    match = re.search(r"^ARG BASE=lmsysorg/sglang:v([0-9.]+)-", SGLANG_DOCKERFILE.read_text(), re.M)
    assert match, "images/sglang/Dockerfile pins no lmsysorg/sglang release"
    return match.group(1)


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own options (those of the pinned release), each with its action, type and choices."""
    table = json.loads((TABLES / f"server_args-v{pinned_version()}.json").read_text())
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False, exit_on_error=False)
    for flag, option in table["options"].items():
        if option["action"] == "store_true":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=TYPES.get(option["type"], str), choices=option["choices"])
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    try:
        return sglang_parser().parse_args(argv[3:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"SGLang v{pinned_version()} would refuse {argv[3:]}: {exc}") from None


def test_the_option_table_is_the_pinned_release():
    assert (TABLES / f"server_args-v{pinned_version()}.json").is_file()


def test_target_with_an_eagle3_draft(tmp_path):
    speculation = Speculation(tmp_path / "draft", num_steps=5, topk=4, num_draft_tokens=16)
    argv = server_argv("Qwen/Qwen3-8B", port=30001, tp=8, trust_remote_code=True, speculation=speculation)
    args = parse(argv)
    assert args.model_path == "Qwen/Qwen3-8B" and args.tp_size == 8 and args.port == 30001
    assert args.trust_remote_code is True
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path == str(tmp_path / "draft")
    speculative = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    assert speculative == (5, 4, 16)


def test_the_same_server_without_speculation():
    args = parse(server_argv("/models/kimi", port=30002, tp=8))
    assert args.speculative_algorithm is None and args.speculative_draft_model_path is None
    assert args.trust_remote_code is False and args.host == "127.0.0.1"


def test_a_flag_the_release_lacks_is_caught():
    argv = server_argv("m", port=1, tp=1)
    with pytest.raises(AssertionError, match="would refuse"):
        parse([*argv, "--speculative-eagle-top-k", "4"])


def test_the_compose_servers_flags(monkeypatch):
    """compose.yaml's sglang service: what SGLang gets after the file's defaults are filled in."""
    command = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())["services"]["sglang"]["command"]
    argv = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(arg)) for arg in command]
    args = parse([sys.executable, "-m", "sglang.launch_server", *argv])
    assert args.enable_memory_saver is True and args.tp_size == 8
