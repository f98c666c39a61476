import pytest
from conftest import orch

pytestmark = pytest.mark.cli


def test_top_help_has_examples():
    result = orch("--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and "orch run phi3_dpo_fsdp --local --nodes 2 --smoke" in result.stdout


@pytest.mark.parametrize("command", ["run", "ls", "show", "cp", "status", "logs", "cancel", "down", "node"])
def test_each_subcommand_help_has_real_examples(command):
    result = orch(command, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and f"orch {command}" in result.stdout.split("examples:")[1]


def test_unknown_subcommand_is_exit_2_one_line():
    result = orch("frobnicate")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "invalid choice" in result.stderr


@pytest.mark.parametrize("argv", [["ls"], ["plan", "Qwen/Qwen3-8B"], ["show", "phi3_dpo_fsdp"]])
def test_a_reader_that_stops_early_gets_no_error_line(argv, tmp_path):
    """`orch ls | head -1` printed `orch: error: Broken pipe` and exited 2. Like `yes | head`, orch now ends quietly
    with 141 (128 + SIGPIPE) when its stdout's reader went away; here the reader leaves before orch writes a byte."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    read, write = os.pipe()
    os.close(read)  # no reader at all
    try:
        done = subprocess.run([sys.executable, "-m", "orchestrator", *argv], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr
