"""The command line as a new user meets it: fast help, argument mistakes refused before a model loads, `tiny` for an
offline checkpoint, the demo's output explained, Ctrl-C on `run` ending cleanly."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_stock_checkpoint

import qwen3vl_static
from qwen3vl_static.checkpoints import QWEN3VL_MODEL_TYPES
from qwen3vl_static.cli import TINY_MAX_NEW_TOKENS, build_parser, load_for_serving, main
from qwen3vl_static.configuration_qwen3vl_graph import Qwen3VLGraphConfig
from qwen3vl_static.dataset_runner import load_processor
from qwen3vl_static.modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration

REPO = Path(__file__).parents[1]


def child(*args, **kwargs):
    return subprocess.Popen([sys.executable, *args], env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def request(request_id, text="Hi", **settings):
    return json.dumps({"id": request_id, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                       **settings})


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return save_stock_checkpoint(tmp_path_factory.mktemp("stock") / "model")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    assert main(["tiny", str(folder)]) == 0
    return folder


def test_help_and_argument_errors_import_neither_torch_nor_transformers(tmp_path):
    """`python -m qwen3vl_static --help` answered in ~5 s, most of it importing torch; now nothing heavy loads."""
    (tmp_path / "empty.jsonl").write_text("\n")
    commands = [["--help"], ["run", "--help"], ["run", str(tmp_path), "--output", "x"],
                ["run", str(tmp_path), "--input", str(tmp_path / "empty.jsonl"), "--output", "x"]]
    for command in commands:
        result = child("-X", "importtime", "-m", "qwen3vl_static", *command, cwd=tmp_path)
        _, stderr = result.communicate(timeout=60)
        imported = {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
        assert result.returncode == (0 if "--help" in command else 1 if "--input" in command else 2), stderr
        assert not imported & {"torch", "transformers"}, command


def test_importing_the_package_registers_the_classes():
    """Outside `python -m qwen3vl_static` the package exports and registers its classes on import."""
    from transformers import AutoConfig

    assert qwen3vl_static.Qwen3VLGraphForConditionalGeneration is Qwen3VLGraphForConditionalGeneration
    assert type(AutoConfig.for_model(Qwen3VLGraphConfig.model_type)) is Qwen3VLGraphConfig
    assert QWEN3VL_MODEL_TYPES == ("qwen3_vl", Qwen3VLGraphConfig.model_type)


def test_every_option_has_help_and_there_is_a_version(capsys):
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {'/'.join(action.option_strings) or action.dest} has no help text"
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"qwen3vl-static {qwen3vl_static.__version__}\n"


def refuse_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.mark.parametrize(("case", "message"), [
    ("not_qwen", "model_type 'llama' in its config.json; only Qwen3-VL checkpoints"),
    ("no_model", "no such folder (nor a Hub repo id"),
    ("no_input", "--input {tmp}/gone.jsonl: no such file"),
    ("empty_input", "holds no requests"),
    ("no_output_folder", "no folder {tmp}/nowhere"),
])
def test_run_refuses_bad_arguments_before_loading_the_model(stock, tmp_path, monkeypatch, capsys, case, message):
    monkeypatch.setattr(Qwen3VLGraphForConditionalGeneration, "from_pretrained", refuse_loading)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "requests.jsonl").write_text(request("q0") + "\n")
    (tmp_path / "empty.jsonl").write_text("\n \n")
    model, input_path, output = str(stock), tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    if case == "not_qwen":
        model = str(tmp_path / "llama")
    elif case == "no_model":
        model = "./not/here"
    elif case == "no_input":
        input_path = tmp_path / "gone.jsonl"
    elif case == "empty_input":
        input_path = tmp_path / "empty.jsonl"
    else:
        output = tmp_path / "nowhere" / "answers.jsonl"
    assert main(["run", model, "--input", str(input_path), "--output", str(output)]) == 1
    error = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in error and "rank 0" not in error, error


def test_counts_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["run", "MODEL", "--input", "x", "--output", "y", "--slots", "0"])
    assert exit.value.code == 2 and "--slots: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--batching-only", "--fp8"], "--fp8: not measured with --batching-only"),
    (["--server", "--serving", "--with-compile"], "--with-compile, --serving: not measured with --server"),
    (["--batching-only", "--speculative"], "--batching-only and --speculative each measure only their own part"),
    (["--server-passes", "3", "--server-concurrency", "64"],
     "--server-concurrency, --server-passes: read only by --server"),
    (["--speculative", "--batching-slots", "128"], "--batching-slots: read only by --batching or --batching-only"),
])
def test_bench_refuses_flags_its_measurement_would_ignore(monkeypatch, capsys, flags, message):
    monkeypatch.setattr("qwen3vl_static.cli._bench", lambda args: pytest.fail("the benchmark ran"))
    assert main(["bench", *flags]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--server", "--server-passes", "3"], ["--batching", "--batching-slots", "128"],
                                   ["--batching-only", "--batching-workloads", "text"]])
def test_bench_takes_a_measurements_flags_with_it(monkeypatch, flags):
    ran = []
    monkeypatch.setattr("qwen3vl_static.cli._bench", lambda args: ran.append(args) or 0)
    assert main(["bench", *flags]) == 0 and len(ran) == 1


def test_tiny_writes_a_converted_checkpoint_that_run_answers_from(tiny, tmp_path):
    assert json.loads((tiny / "config.json").read_text())["model_type"] == Qwen3VLGraphConfig.model_type
    processor = load_processor(tiny)  # tokenizer and image processor
    assert processor.decode(processor.tokenizer("Hi")["input_ids"]) == "Hi"
    (tmp_path / "requests.jsonl").write_text(request("q0") + "\n" + request("q1", max_new_tokens=3) + "\n")
    output = tmp_path / "answers.jsonl"
    assert main(["run", str(tiny), "--input", str(tmp_path / "requests.jsonl"), "--output", str(output)]) == 0
    tokens = [json.loads(line)["generated_tokens"] for line in output.read_text().splitlines()]
    assert tokens[1] == 3 and 1 <= tokens[0] <= TINY_MAX_NEW_TOKENS


def test_kv_cache_dtype_reaches_the_model_of_run_and_serve(tiny, tmp_path):
    model = load_for_serving(str(tiny), "cpu", 64, "fp8")
    assert (model.config.kv_cache_dtype, model.config.static_cache_len) == ("fp8", 64)
    assert load_for_serving(str(tiny), "cpu", None).config.kv_cache_dtype == "auto"
    (tmp_path / "requests.jsonl").write_text(request("q0", max_new_tokens=3) + "\n")
    output = tmp_path / "answers.jsonl"
    assert main(["run", str(tiny), "--input", str(tmp_path / "requests.jsonl"), "--output", str(output),
                 "--kv-cache-dtype", "fp8"]) == 0
    assert json.loads(output.read_text())["generated_tokens"] == 3


def test_demo_says_that_random_weights_give_gibberish(capsys):
    assert main(["demo", "--new-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "random weights: the tokens are gibberish, as expected" in out and "one run" in out


@pytest.mark.slow  # a process that imports torch and transformers
def test_ctrl_c_on_run_exits_130_keeping_the_answers_and_a_rerun_finishes(stock, tmp_path):
    lines = [request(f"q{index}", f"Question {index}", max_new_tokens=64) for index in range(24)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    output = tmp_path / "answers.jsonl"
    arguments = ["run", str(stock), "--input", str(tmp_path / "requests.jsonl"), "--output", str(output), "--device",
                 "cpu"]
    # One at a time: seconds. Ctrl-C as at a terminal: a suite started in the background (no job control) ignores
    # SIGINT, and a child would inherit that and run to its end.
    process = child("-m", "qwen3vl_static", *arguments, "--slots", "1", cwd=tmp_path,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_text().count("\n")) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr and "torchvision" not in stderr, stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]  # each whole
    assert f"interrupted; answers in {output} so far: {len(records)}; the same command again answers the rest" in stderr
    assert 1 <= len(records) < len(lines) and all(record["error"] is None for record in records)
    assert main(arguments) == 0
    assert sorted(json.loads(line)["id"] for line in output.read_text().splitlines()) == sorted(
        f"q{index}" for index in range(24))
