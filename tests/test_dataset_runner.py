"""`python -m qwen3vl_static run`: answers as `generate` gives them alone, bad lines as error records, resuming."""

import json
import shutil

import pytest
import torch
from conftest import save_stock_checkpoint
from PIL import Image

from qwen3vl_static.batching_qwen3vl_graph import steps_past_end
from qwen3vl_static.cli import main
from qwen3vl_static.dataset_runner import load_processor
from qwen3vl_static.modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import model_dir, tiny_config


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dataset")
    save_stock_checkpoint(folder / "model")
    Image.new("RGB", (64, 64), "red").save(folder / "red.png")
    return folder


def requests(workdir):
    """Six good requests (more than the 4 cache rows; images by relative and absolute path) and four bad lines."""
    good = [{"id": f"q{index}", "max_new_tokens": 3 + index,
             "messages": user({"type": "image", "image": "red.png" if index % 2 else str(workdir / "red.png")},
                              {"type": "text", "text": f"What is in picture {index}?"}) if index % 3 else
             user({"type": "text", "text": "Hi" * (index + 1)})} for index in range(6)]
    bad = ['{"id": "broken"', json.dumps({"id": "noimage", "messages": user({"type": "image", "image": "gone.png"})}),
           json.dumps({"id": "typo", "messages": user({"type": "text", "text": "x"}), "max_tokens": 3}),
           json.dumps(good[0])]  # a second line with the same id
    return good, bad


def expected_answers(workdir, good):
    model = Qwen3VLGraphForConditionalGeneration.from_pretrained(workdir / "model", dtype=torch.float32).eval()
    processor = load_processor(workdir / "model")
    answers = {}
    for request in good:
        messages = [{**message, "content": [{**part, "image": str(workdir / part["image"])} if "image" in part else part
                                            for part in message["content"]]} for message in request["messages"]]
        inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=request["max_new_tokens"], do_sample=False)
        answers[request["id"]] = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return answers


def run(workdir, lines, output, model="model", *flags):
    (workdir / "requests.jsonl").write_text("".join(f"{line}\n" for line in lines))
    return main(["run", str(workdir / model), "--input", str(workdir / "requests.jsonl"), "--output", str(output),
                 "--greedy", "--device", "cpu", *flags])


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_equal_generate_and_bad_lines_become_errors(workdir, tmp_path, capsys):
    good, bad = requests(workdir)
    output = tmp_path / "answers.jsonl"
    assert run(workdir, [json.dumps(request) for request in good[:3]] + bad + [json.dumps(r) for r in good[3:]],
               output) == 1  # some requests failed
    assert "requests failed: 4, answered: 6" in capsys.readouterr().err
    got = {record["id"]: record for record in records(output)}
    assert {request_id: got[request_id]["answer"] for request_id in expected_answers(workdir, good)} == \
        expected_answers(workdir, good)
    assert all(got[request["id"]]["generated_tokens"] == request["max_new_tokens"] for request in good)
    errors = {record["id"]: record["error"] for record in records(output) if record["error"]}
    assert set(errors) == {"line 4", "noimage", "typo", "line 7"}
    assert "JSON" in errors["line 4"] and "max_tokens" in errors["typo"]
    assert errors["noimage"] == (f"line 5: ValueError: image file not found: 'gone.png' (looked for "
                                 f"{workdir}/gone.png; a relative path is relative to the input file's folder)")
    assert errors["line 7"] == "line 1 of the input has the id 'q0' already"
    # The output ends in input order (answers were appended as they finished).
    assert [record["id"] for record in records(output)] == ["q0", "q1", "q2", "line 4", "noimage", "typo", "line 7",
                                                             "q3", "q4", "q5"]


def test_a_rerun_answers_only_what_is_missing(workdir, tmp_path):
    good, bad = requests(workdir)
    output = tmp_path / "answers.jsonl"
    assert run(workdir, [json.dumps(request) for request in good[:2]], output) == 0
    first = output.read_text()
    output.write_text(first + '{"id": "q5", "answ')  # a run killed mid-write
    with_bad = [json.dumps(request) for request in good] + [bad[0], bad[3]]  # bad JSON; a second line of q0
    assert run(workdir, with_bad, output) == 1
    lines = records(output)
    assert output.read_text().startswith(first)  # what was written stays as it was
    answered = [record["id"] for record in lines if record["error"] is None]
    assert sorted(answered) == [request["id"] for request in good]  # each once
    # The next rerun runs the bad lines again (the duplicate of the answered q0 too); answers are not repeated.
    assert run(workdir, with_bad, output) == 1
    assert sorted(map(json.dumps, records(output))) == sorted(map(json.dumps, lines))
    assert {record["id"] for record in records(output) if record["error"]} == {"line 7", "line 8"}


def test_qwens_generation_config_sets_no_length_and_bad_lengths_fail_alone(workdir, tmp_path, capsys):
    """Qwen's own 2B generation config sets neither max_new_tokens nor max_length: a request that sets none gets
    what its cache row holds; 0, negative and non-integer lengths fail that request alone, naming the field."""
    model = tmp_path / "model"
    shutil.copytree(workdir / "model", model)
    shutil.copy(model_dir("2b") / "generation_config.json", model)
    text = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    lines = [json.dumps({"id": "free", "messages": [text]})] + [
        json.dumps({"id": f"bad{index}", "max_new_tokens": value, "messages": [text]})
        for index, value in enumerate([0, -5, "ten"])]
    output = tmp_path / "answers.jsonl"
    assert run(tmp_path, lines, output, "model", "--cache-len", "64") == 1
    assert "requests failed: 3, answered: 1" in capsys.readouterr().err
    got = {record["id"]: record for record in records(output)}
    prompt = len(load_processor(model).apply_chat_template([text], tokenize=True, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"][0])
    past_end = steps_past_end(tiny_config().steps_per_sync)
    # Random weights draw an EOS now and then; the answer is never longer than the row leaves.
    assert got["free"]["error"] is None and 1 <= got["free"]["generated_tokens"] <= 64 - prompt - past_end
    assert got["bad0"]["error"] == "line 2: ValueError: max_new_tokens=0: a request generates at least 1 token."
    assert got["bad1"]["error"] == "line 3: ValueError: max_new_tokens=-5: a request generates at least 1 token."
    assert got["bad2"]["error"].startswith("line 4: ValueError: Request settings of the wrong type: "
                                           "max_new_tokens='ten'")
