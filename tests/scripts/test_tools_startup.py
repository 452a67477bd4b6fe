"""How every tool starts (tools/, benchmarks/, train.py, train-dist.py): the installed package imported as
it is (no ``sys.path`` edits), one start-up (gnetmdk.engine.cli.tool_main: a user error is one ``error:``
line and exit status 2) and one way of reading the command line: ``--config`` and the options first, then
``KEY VALUE`` overrides, an override never read as a path."""
import ast
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

from gnetmdk.config import ConfigError
from gnetmdk.engine.cli import tool_main
from repo_paths import REPO

ROOT = REPO
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 + [os.path.join(ROOT, "train.py"), os.path.join(ROOT, "train-dist.py")])
#: override words whose values look like paths; a path-taking positional must never receive one
OVERRIDES = ["checkpoint_root", "runs/x/checkpoint", "model_root", "runs/x/model", "threads=1"]


def _load(rel):
    """A script as a module, by its path (as the other tests load the tools)."""
    name = "startup_" + rel.replace("/", "_").replace("-", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_script_edits_sys_path():
    """The scripts import the installed package (pip install -e .): none inserts the repository (or its
    own folder) into sys.path."""
    found = []
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(open(path).read())):
            f = getattr(node, "func", None)
            if (isinstance(f, ast.Attribute) and f.attr in ("insert", "append", "extend")
                    and isinstance(f.value, ast.Attribute) and f.value.attr == "path"
                    and isinstance(f.value.value, ast.Name) and f.value.value.id == "sys"):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, found


#: (script, options before the overrides, (attribute, value) of a positional that must not take an override);
#: the first three leave an optional path free: a word that names no field may be that path there
FREE_PATH = 3
TOOLS = [
    ("tools/chip_eval.py", ["--config", "C", "--check"], ("chip_model", None)),
    ("tools/convert_to_chip.py", ["--config", "C"], ("checkpoint", None)),
    ("tools/export_int.py", ["--config", "C"], ("checkpoint", None)),
    ("tools/convert_to_chip.py", ["ck/best.pth", "--config", "C"], ("checkpoint", "ck/best.pth")),
    ("tools/export_int.py", ["--config", "C", "ck/best.pth"], ("checkpoint", "ck/best.pth")),
    ("tools/eval_voc.py", ["ck/best.pth", "--config", "C", "--split", "train"], ("checkpoint", "ck/best.pth")),
    ("tools/convert_weights.py", ["-f", "C", "-c", "w.pdparams", "-oc", "o.pth"], ("config", "C")),
    ("tools/sensitivity.py", ["--config", "C", "--weights", "w.pth"], ("weights", "w.pth")),
    ("tools/stage_report.py", ["--config", "C", "--no-chip"], ("config", "C")),
    ("tools/run_pipeline.py", ["--config", "C", "--stages", "step1", "--control"], ("config", "C")),
    ("benchmarks/bench_step_time.py", ["--config", "C", "--trainer"], ("config", "C")),
    ("benchmarks/profile_trainer.py", ["--config", "C", "--iters", "2"], ("config", "C")),
    ("benchmarks/small_objects.py", ["--iters", "50", "--out", "runs/s"], ("out", "runs/s")),
    ("benchmarks/accuracy.py", ["--seeds", "0", "--table-only"], ("seeds", "0")),
]


@pytest.mark.parametrize("script,options,positional", TOOLS, ids=[f"{t[0]}-{i}" for i, t in enumerate(TOOLS)])
def test_each_tool_reads_options_then_overrides(script, options, positional, capsys):
    """parse_args of every tool that takes config overrides: the words after the options are overrides,
    path values included (never a positional's path); words after the options that name no field are
    overrides too where no optional path is left to fill (the config refuses them by name); an option
    after the overrides is one error line."""
    tool = _load(script)
    args, rest = tool.parse_args(options + OVERRIDES)
    assert rest == OVERRIDES and getattr(args, positional[0]) == positional[1]
    if TOOLS.index((script, options, positional)) >= FREE_PATH:
        args, rest = tool.parse_args(options + ["no_such_field", "1", *OVERRIDES])
        assert rest == ["no_such_field", "1", *OVERRIDES] and getattr(args, positional[0]) == positional[1]
    with pytest.raises(SystemExit) as stop:
        tool.parse_args(options + OVERRIDES + ["--zzz", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: option --zzz comes after the config overrides")
    assert len(err.strip().splitlines()) == 1


def test_xml_2_txt_reads_options_then_overrides():
    """xml_2_txt (and xml_2_json, which shares its command line) returns its overrides as args.overrides."""
    args = _load("tools/xml_2_txt.py").parse_args(["--config", "C", "--skip-bad", *OVERRIDES])
    assert args.config == "C" and args.skip_bad and args.overrides == OVERRIDES


def test_tools_start_through_tool_main():
    """Every tool's main that reads a config or a checkpoint is wrapped by the one start-up, tool_main
    (paddle_reference runs in the paddle environment without gnetmdk; xml_2_json calls xml_2_txt's;
    gpu_check and demo_check only start other scripts and import no gnetmdk; bench_memory's main
    also runs its child processes)."""
    wrapped = ["chip_eval", "convert_to_chip", "convert_weights", "diff_weights", "eval_voc", "export_int",
               "make_shapes", "plot_lr_schedules", "predict", "run_pipeline", "sensitivity", "stage_report",
               "tile_voc", "xml_2_txt"]
    for name in wrapped:
        assert hasattr(_load(f"tools/{name}.py").main, "__wrapped__"), name
    for name in ("bench_step_time", "profile_trainer", "small_objects", "accuracy", "bench_chip", "bench_dist"):
        assert hasattr(_load(f"benchmarks/{name}.py").main, "__wrapped__"), name
    from gnetmdk.engine.cli import main
    assert hasattr(main, "__wrapped__")


def test_tool_main_maps_user_errors_to_one_line(capsys, monkeypatch):
    """tool_main: the command line from sys.argv when none is given; a user error is one ``error:`` line
    and status 2 (or the error's exit_code); --help's SystemExit and other errors pass through."""
    seen = []

    @tool_main
    def main(argv, flag=False):
        seen.append((argv, flag))
        if argv[:1] == ["user"]:
            raise ConfigError("field 'x' is wrong: set x 1")
        if argv[:1] == ["coded"]:
            err = ConfigError("peer failed")
            err.exit_code = 3
            raise err
        if argv[:1] == ["bug"]:
            raise RuntimeError("a bug")
        if argv[:1] == ["help"]:
            raise SystemExit(0)
        return 0

    monkeypatch.setattr(sys, "argv", ["tool.py", "a", "b"])
    assert main() == 0 and seen[-1] == (["a", "b"], False)
    assert main(("c",), flag=True) == 0 and seen[-1] == (["c"], True)
    capsys.readouterr()
    assert main(["user"]) == 2 and capsys.readouterr().err == "error: field 'x' is wrong: set x 1\n"
    assert main(["coded"]) == 3 and capsys.readouterr().err == "error: peer failed\n"
    with pytest.raises(RuntimeError):
        main(["bug"])
    with pytest.raises(SystemExit) as stop:
        main(["help"])
    assert stop.value.code == 0


def test_scripts_run_from_any_folder_with_the_installed_package(tmp_path):
    """Run from another folder, the tools find the installed package: convert_to_chip reads the words
    after --config as overrides (the checkpoint it looks for is under the overridden checkpoint_root),
    and xml_2_json (which loads xml_2_txt beside it) describes the COCO-json files it writes."""
    ck, model = str(tmp_path / "ck"), str(tmp_path / "model")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_chip.py"), "--config",
                        os.path.join(ROOT, "examples", "cards.py"), "checkpoint_root", ck, "model_root", model],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: checkpoint '{os.path.join(ck, 'step4', 'best.pth')}' does not exist")
    assert not os.path.exists(model)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_json.py"), "--help"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "into COCO-json files" in r.stdout and "train_json" in r.stdout and "meta files" not in r.stdout
