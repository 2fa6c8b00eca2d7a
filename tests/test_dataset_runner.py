"""`python -m qwen3vl_static run`: answers as `generate` gives them alone, bad lines as error records, resuming."""

import json

import pytest
import torch
from conftest import save_stock_checkpoint
from PIL import Image

from qwen3vl_static.cli import main
from qwen3vl_static.dataset_runner import load_processor
from qwen3vl_static.modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration


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


def run(workdir, lines, output):
    (workdir / "requests.jsonl").write_text("".join(f"{line}\n" for line in lines))
    return main(["run", str(workdir / "model"), "--input", str(workdir / "requests.jsonl"), "--output", str(output),
                 "--greedy", "--device", "cpu"])


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_equal_generate_and_bad_lines_become_errors(workdir, tmp_path):
    good, bad = requests(workdir)
    output = tmp_path / "answers.jsonl"
    assert run(workdir, [json.dumps(request) for request in good[:3]] + bad + [json.dumps(r) for r in good[3:]],
               output) == 0
    got = {record["id"]: record for record in records(output)}
    assert {request_id: got[request_id]["answer"] for request_id in expected_answers(workdir, good)} == \
        expected_answers(workdir, good)
    assert all(got[request["id"]]["generated_tokens"] == request["max_new_tokens"] for request in good)
    errors = {record["id"]: record["error"] for record in records(output) if record["error"]}
    assert set(errors) == {"line 4", "noimage", "typo", "line 7"}
    assert "JSON" in errors["line 4"] and "gone.png" in errors["noimage"] and "max_tokens" in errors["typo"]
    assert "the id 'q0'" in errors["line 7"]
    # The output ends in input order (answers were appended as they finished).
    assert [record["id"] for record in records(output)] == ["q0", "q1", "q2", "line 4", "noimage", "typo", "line 7",
                                                             "q3", "q4", "q5"]


def test_a_rerun_answers_only_what_is_missing(workdir, tmp_path):
    good, bad = requests(workdir)
    output = tmp_path / "answers.jsonl"
    assert run(workdir, [json.dumps(request) for request in good[:2]], output) == 0
    first = output.read_text()
    output.write_text(first + '{"id": "q5", "answ')  # a run killed mid-write
    assert run(workdir, [json.dumps(request) for request in good] + bad[:1], output) == 0
    lines = records(output)
    assert output.read_text().startswith(first)  # what was written stays as it was
    answered = [record["id"] for record in lines if record["error"] is None]
    assert sorted(answered) == [request["id"] for request in good]  # each once
    # The next rerun runs the bad line again (its error record moves to the end); answers are not repeated.
    assert run(workdir, [json.dumps(request) for request in good] + bad[:1], output) == 0
    assert sorted(map(json.dumps, records(output))) == sorted(map(json.dumps, lines))
