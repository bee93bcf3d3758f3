"""The launcher's command line, in this process where it must stop before starting
anything: bad arguments and a busy --master_port fail fast with one line, every option
takes both spellings (snake_case and kebab-case), torchrun's --standalone and
--nproc_per_node auto, a new option is one row of cli.OPTIONS, and docs/launching.md's
table lists every option.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
from launch_helpers import REPO, SCRIPTS, auto_nproc, run_in_process


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc_per_node", "0", "SCRIPT"], "nproc_per_node"),
        (["--nnodes", "0", "SCRIPT"], "nnodes"),
        (["--nnodes", "2", "--node_rank", "2", "SCRIPT"], "node_rank"),
        (["--master_port", "0", "SCRIPT"], "master_port"),
        (["--master_port", "65536", "SCRIPT"], "master_port"),
        (["does_not_exist.py"], "not found"),
        ([], "no script"),
    ],
)
def test_bad_arguments_fail_fast(tmp_path: Path, args: list[str], message: str, capsys,
                                monkeypatch) -> None:
    # in this process (the checks come before anything starts): an exception other
    # than the one-line exit would fail the test here
    from globaltensor.launch import main
    monkeypatch.chdir(tmp_path)
    args = [str(SCRIPTS / "report_env.py") if a == "SCRIPT" else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(["--log_dir", str(tmp_path / "log"), *args])
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "log").exists()  # nothing was started


@pytest.mark.timeout(30)
def test_busy_master_port_is_one_line(tmp_path: Path, capfd, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run_in_process(["--nproc_per_node", "2", "--master_port", str(port), "--log_dir",
                                  str(tmp_path / "log"), str(SCRIPTS / "report_env.py")], capfd)
    assert code == 1
    assert err.strip().splitlines() == [
        f"globaltensor.launch: error: --master_port {port} is already in use on 127.0.0.1 "
        "(another job, or one still exiting?): choose another --master_port"], err
    assert "ENV" not in out


OPTION_VALUES = {"nproc_per_node": "3", "nnodes": "2", "node_rank": "1", "master_addr": "10.0.0.2",
                 "master_port": "1234", "log_dir": "mylogs", "max_restarts": "2", "rdzv_timeout": "7"}


@pytest.mark.parametrize("spell", [lambda name: f"--{name}", lambda name: f"--{name.replace('_', '-')}"],
                         ids=["snake_case", "kebab-case"])
def test_every_option_takes_both_spellings(spell, tmp_path: Path, monkeypatch) -> None:
    from globaltensor.launch import parse_args

    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "hold.py")
    argv = [a for name, value in OPTION_VALUES.items() for a in (spell(name), value)]
    args = parse_args([*argv, script, "--x"])
    assert {name: str(getattr(args, name)) for name in OPTION_VALUES} == {
        **OPTION_VALUES, "rdzv_timeout": "7.0"}
    assert args.script == script and args.script_args == ["--x"]
    equals = [f"{spell(name)}={value}" for name, value in OPTION_VALUES.items()]
    assert vars(parse_args([*equals, script, "--x"])) == vars(args)
    ps = parse_args([spell("server_num"), "1", spell("worker_num"), "2", "--standalone", "-m", "mod", "--y"])
    assert (ps.ps, ps.nproc_per_node, ps.standalone, ps.module, ps.script_args) == ((1, 2), 3, True, True, ["--y"])


def test_standalone_and_nproc_auto_are_parsed_as_torchrun(tmp_path: Path, monkeypatch, capsys) -> None:
    from globaltensor.launch import parse_args

    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "hold.py")
    args = parse_args(["--nproc_per_node", "auto", script])
    assert args.nproc_per_node == auto_nproc() and not args.standalone
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29500)
    assert parse_args(["--nproc-per-node=cpu", script]).nproc_per_node == len(os.sched_getaffinity(0))
    args = parse_args(["--standalone", "--master_addr", "10.1.1.1", "--master_port", "1234", script])
    # the endpoint is overridden: main binds a free port (0 here) on 127.0.0.1
    assert (args.master_addr, args.master_port, args.nnodes) == ("127.0.0.1", 0, 1)
    assert args.master_ignored == ["--master_addr", "--master_port"]
    for argv, message in [(["--nproc_per_node", "many", script], "--nproc_per_node 'many'"),
                          (["--standalone", "--nnodes", "2", script], "--standalone runs a single node")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_new_option_is_one_row_of_the_table_in_cli(tmp_path: Path, monkeypatch) -> None:
    """The parser, both spellings and the split between the launcher's arguments and the
    script's come from cli.OPTIONS: a new flag does not swallow the script as its value."""
    from globaltensor.launch import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "OPTIONS", (*cli.OPTIONS, cli.Option("dry_run", "only print", flag=True),
                                         cli.Option("retry_after", "seconds", type=float, default=1.0)))
    script = str(SCRIPTS / "hold.py")
    args = cli.parse_args(["--dry-run", "--retry_after", "2.5", script, "--dry_run"])
    assert (args.dry_run, args.retry_after, args.script, args.script_args) == (True, 2.5, script, ["--dry_run"])
    args = cli.parse_args(["--retry-after=4", script])
    assert (args.dry_run, args.retry_after, args.script_args) == (False, 4.0, [])
    assert "--dry_run, --dry-run" in cli.build_parser().format_help()


def test_every_launcher_option_is_in_the_readme_table() -> None:
    """docs/launching.md's launcher table lists every option of the parser, and nothing else
    (the dash spellings are covered by one sentence there)."""
    from globaltensor.launch.cli import build_parser

    text = (REPO / "docs" / "launching.md").read_text()
    section = text.split("<!-- launching:start -->")[1].split("<!-- launching:end -->")[0]
    documented = {name for row in section.splitlines() if row.startswith("| `")
                  for name in re.findall(r"`(-[^`]+)`", row.split("|")[1])}
    options = {spelling for action in build_parser()._actions for spelling in action.option_strings
               if "-" not in spelling.lstrip("-")} - {"-h", "--help"}
    assert options == documented, (f"not in the docs/launching.md table: {sorted(options - documented)}; "
                                   f"in the table, not an option: {sorted(documented - options)}")
