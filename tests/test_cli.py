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
