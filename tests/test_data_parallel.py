"""`torchrun --nproc-per-node 2 -m qwen3vl_static run ...` on the CPU (gloo): requests shared out by cost, one merged
output in input order equal to the single-process run's, and a rank killed mid-run loses nothing it wrote."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_stock_checkpoint
from PIL import Image

from qwen3vl_static.cli import main
from qwen3vl_static.dataset_runner import part_path, share_out

REPO = Path(__file__).parents[1]


def test_share_out_balances_cost_not_count():
    ranks = share_out([100, 1, 1, 1, 1, 90, 1, 1], 2)
    assert ranks == [0, 1, 1, 1, 1, 1, 1, 1]  # loads 100 and 96 (by count: 4 requests each, 103 against 93)
    assert share_out([5] * 5, 1) == [0] * 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def arguments(folder, output):
    return ["run", str(folder / "model"), "--input", str(folder / "requests.jsonl"), "--output", str(output),
            "--greedy", "--device", "cpu"]


def rank_process(folder, output, rank, port):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "qwen3vl_static", *arguments(folder, output)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # processes that import torch and transformers
def test_two_ranks_merge_into_the_single_process_output_and_survive_a_killed_rank(tmp_path):
    save_stock_checkpoint(tmp_path / "model")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    image = {"type": "image", "image": "red.png"}
    lines = [json.dumps({"id": f"q{index}", "max_new_tokens": 4 + index % 5 * 6, "messages": [
        {"role": "user", "content": [*([image] if index % 3 == 0 else []),
                                     {"type": "text", "text": f"Question {index}" + "?" * index}]}]})
             for index in range(24)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines + ["not json"]) + "\n")
    single = tmp_path / "single.jsonl"
    assert main(arguments(tmp_path, single)) == 1  # the line that is not JSON failed
    expected = single.read_text()

    # Two ranks; rank 1 is killed once it has written an answer, then rank 0 is stopped as torchrun would stop it.
    output = tmp_path / "answers.jsonl"
    port = free_port()
    ranks = [rank_process(tmp_path, output, rank, port) for rank in range(2)]
    part = part_path(output, 1)
    deadline = time.monotonic() + 120
    while not (part.exists() and '"error": null' in part.read_text()) and time.monotonic() < deadline:
        assert ranks[1].poll() is None, ranks[1].stderr.read()
        time.sleep(0.02)
    for process in ranks[::-1]:
        process.kill()
        process.wait()
    written = [json.loads(line) for line in part.read_text().splitlines()]  # each record whole
    answered = [record["id"] for record in written if record["error"] is None]
    assert answered
    assert not output.exists()  # no merge happened

    # torchrun to the end: what rank 1 wrote is kept (skipped, not answered again); one output, in input order.
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "qwen3vl_static", *arguments(tmp_path, output)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]  # rank 0, after the merge, for the line that is not JSON
    assert "requests failed: 1, answered: " in result.stderr, result.stderr[-3000:]
    assert output.read_text() == expected
    assert not list(tmp_path.glob("answers.jsonl.rank*"))
    skipped = sum(int(line.split("skipped ")[1].split(" ")[0]) for line in result.stdout.splitlines() if "skipped" in line)
    assert skipped >= len(answered)
