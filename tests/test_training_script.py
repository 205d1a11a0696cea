"""`--script path.py:make`: the user's own model, optimizer, batches and loss (with a scheduler whose
state belongs to the checkpoint), trained for real by train-check in this and a fresh process; a
pack made with it runs that script again only from a path the user gives (whose bytes must be the
recorded ones) or with --allow-pack-option script. What make() returns is checked first.
"""

from __future__ import annotations

import json

import pytest

from detllm.core.errors import UsageError
from detllm.training.script import ScriptRun, load_script

pytestmark = pytest.mark.engine

SCRIPT = '''
import torch

def make():
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.randint(0, 32, (16, 6), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": data[i:i + 4]} for i in range(0, 16, 4)] * 2

    def loss_fn(m, batch):
        ids = batch["input_ids"]
        return torch.nn.functional.cross_entropy(m(ids[:, :-1]).reshape(-1, 32), ids[:, 1:].reshape(-1))

    return model, opt, batches, loss_fn, sched
'''


@pytest.fixture(scope="module")
def script_pack(tmp_path_factory):
    from detllm.training.check import train_check

    root = tmp_path_factory.mktemp("script")
    (root / "train.py").write_text(SCRIPT)
    outcome = train_check(script=f"{root / 'train.py'}:make", steps=4, repeats=1, fresh_process=1, out=root / "pack")
    return root, outcome


def test_a_script_trains_bitwise_here_and_in_a_fresh_process(script_pack):
    root, outcome = script_pack
    assert outcome.exit_code == 0, outcome.text()
    assert [r["process"] for r in outcome.report["runs"]] == ["reference", "same", "fresh"]
    config = json.loads((root / "pack" / "train_config.json").read_text())
    assert config["task"]["kind"] == "script" and config["task"]["entry"] == "train.py:make"
    assert config["optimizer"]["name"] == "AdamW" and config["optimizer"]["scheduler"] == "StepLR"
    assert (root / "pack" / "script.py.txt").read_text() == SCRIPT
    desc = json.loads((root / "pack.checkpoints" / "boundary_000003" / "checkpoint.json").read_text())
    assert desc["extra"]["scheduler"]["last_epoch"] == 3  # the scheduler's state belongs to the checkpoint


def test_replay_runs_the_script_only_when_given_or_allowed(script_pack, cli):
    root, _ = script_pack
    pack = root / "pack"
    res = cli("replay", pack, "--out", root / "r0")
    assert res.exit_code == 2 and "--allow-pack-option script" in res.output and not (root / "r0").exists()
    (root / "other.py").write_text(SCRIPT + "# edited\n")
    res = cli("replay", pack, "--script", root / "other.py", "--out", root / "r1")
    assert res.exit_code == 6 and "not the script the pack was made with" in res.output
    res = cli("replay", pack, "--script", root / "train.py", "--sample", "2/4", "--sample-seed", "1", "--out", root / "r2")
    assert res.exit_code == 0 and res.output.count("landed on its committed h") == 2, res.output  # lr halved: scheduler restored
    res = cli("replay", pack, "--allow-pack-option", "script", "--out", root / "r3")
    assert res.exit_code == 0 and "steps 0..3 from genesis: landed" in res.output, res.output


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "s.py"
    p.write_text("import torch\n" + body)
    return f"{p}:make"


@pytest.mark.parametrize("body,says", [
    ("def other():\n    pass\n", "has no function 'make'"),
    ("def make():\n    return 1\n", "must return model, optimizer, batches, loss_fn"),
    ("def make():\n    m = torch.nn.Linear(2, 2)\n    return 'model', torch.optim.SGD(m.parameters(), lr=1), [], len\n",
     "not a torch.nn.Module"),
    ("def make():\n    m, o = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)\n"
     "    return m, torch.optim.SGD(o.parameters(), lr=1), [], len\n", "not the model's parameters"),
    ("def make():\n    m = torch.nn.Linear(2, 2)\n    ds = torch.utils.data.TensorDataset(torch.zeros(4, 2, dtype=torch.long))\n"
     "    return m, torch.optim.SGD(m.parameters(), lr=1), torch.utils.data.DataLoader(ds, num_workers=2), len\n",
     "num_workers=2 is refused"),
    ("def make():\n    m = torch.nn.Linear(2, 2)\n    return m, torch.optim.SGD(m.parameters(), lr=1), [], len, object()\n",
     "scheduler has no state_dict()"),
    ("raise RuntimeError('boom')\n", "failed while loading: RuntimeError: boom"),
])
def test_what_make_returns_is_checked(tmp_path, body, says):
    with pytest.raises(UsageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_script(_script(tmp_path, body))


def test_bad_specs_and_accumulation(tmp_path, cli):
    for spec in ("nope.py:make", f"{tmp_path}/x.txt:make", "train.py:not-a-name"):
        with pytest.raises(UsageError):
            load_script(spec)
    (tmp_path / "train.py").write_text(SCRIPT)
    run = ScriptRun(load_script(f"{tmp_path / 'train.py'}"), grad_accumulation=2)  # `make` by default
    batch = run.next_batch(None)
    assert [tuple(m.shape) for m in batch.micro] == [(2, 6), (2, 6)] and batch.samples == [0]
    assert run.loss(batch.micro[1]).item() > 0  # loss_fn called on the micro-batch those ids came from
    res = cli("train-check", "--script", tmp_path / "missing.py", "--out", tmp_path / "p")
    assert res.exit_code == 2 and not (tmp_path / "p").exists()
