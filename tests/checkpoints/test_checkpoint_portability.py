"""A checkpoint saved by one method loads into any other method and world size: fsdp (sharded, 2 ranks) ->
ddp (2 ranks) -> single, fsdp's folder -> fsdp on 1 rank, and `stratbench consolidate` -> one file for single.

Two exact checks: (1) resuming continues the uninterrupted run - steps 11-20 after resuming equal the
reference's steps 11-20 to conftest.RTOL (fp64), which needs the weights, the momentum buffers, the LR schedule and the data
position to come back; (2) the val accuracy `single` measures right after loading a checkpoint is the one the
saving run measured on the same weights (the engine evaluates the final weights, then saves them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import EQUIV, RTOL, assert_curves_match, cli, train

pytestmark = pytest.mark.equivalence


@pytest.fixture(scope="module")
def chain(tmp_path_factory, reference_run) -> dict:
    """Reference (single, 20 steps) and fsdp trained 10 steps on 2 ranks, saving a sharded checkpoint."""
    root = tmp_path_factory.mktemp("portability")
    ref = reference_run
    fsdp = train(root / "fsdp", "--strategy", "fsdp", *EQUIV, "--max-steps", "10", nproc=2)
    return {"root": root, "ref": ref, "fsdp": fsdp, "folder": root / "fsdp" / "checkpoints" / "last"}


def single_loads(path: Path) -> tuple[float, dict[str, torch.Tensor], dict]:
    """In this process, without a process group: the `single` strategy loads ``path`` through its own
    load_checkpoint; returns the engine's val accuracy on the loaded weights, the model and optimizer state."""
    from stratbench.checkpoints import checkpoint
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.core.dist import DistEnv, seed_everything
    from stratbench.core.optim import lr_lambda, optimizer_spec
    from stratbench.data.datasets import build_data
    from stratbench.models.zoo import build_model
    from stratbench.strategies.base import get_strategy
    from stratbench.training.engine import Trainer

    saved = from_dict(TrainConfig, checkpoint.read_meta(path)["config"])
    cfg = saved.replace(strategy="single", strategy_options={}, nproc=1, output=str(path.parent / "unused"))
    trainer = Trainer(cfg, DistEnv(), get_strategy("single"))
    seed_everything(cfg.seed)
    bundle = build_data(cfg)
    model = build_model(cfg.model, bundle.num_classes, cifar_stem=cfg.cifar_stem, norm=cfg.norm, width=cfg.width)
    model, optimizer = trainer.strategy.setup(model, optimizer_spec(cfg))
    # As in the engine: the scheduler exists before the load (it adds initial_lr to the param groups).
    torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, 100))
    trainer.strategy.checkpoint_io.load_checkpoint(path, model, optimizer)
    accuracy = trainer.evaluate(model, bundle)["val_accuracy"]
    return accuracy, {k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()


@pytest.mark.distributed
def test_fsdp_writes_a_dcp_folder(chain):
    from stratbench.checkpoints import checkpoint

    folder = chain["folder"]
    assert folder.is_dir() and (folder / ".metadata").is_file()
    assert len(list(folder.glob("*.distcp"))) == 2, "each of the 2 ranks writes its own shards"
    meta = checkpoint.read_meta(folder)
    assert meta["layout"] == "dcp" and meta["strategy"] == "fsdp" and meta["world_size"] == 2
    assert meta["progress"]["step"] == 10
    assert not list(folder.parent.glob(".last.*")), "no temporary folder left behind"


@pytest.mark.distributed
def test_fsdp_to_ddp_to_single(chain):
    """fsdp (sharded) -> ddp resumes and continues the same run -> single loads ddp's file, same val accuracy."""
    ref = chain["ref"]["metrics"]["loss_curve"]
    ddp = train(chain["root"] / "ddp", "--strategy", "ddp", *EQUIV, "--resume-from", str(chain["folder"]), nproc=2)
    assert ddp["resumed_from"]["step"] == 10
    assert_curves_match(ddp["metrics"]["loss_curve"], ref[10:], RTOL)
    assert ddp["metrics"]["val_accuracy"] < 1.0  # not a degenerate model that every load would "match"
    ddp_file = chain["root"] / "ddp" / "checkpoints" / "last"
    accuracy, _, _ = single_loads(ddp_file)
    assert accuracy == ddp["metrics"]["val_accuracy"]


@pytest.mark.distributed
def test_single_loads_the_sharded_folder(chain):
    """2 ranks -> 1 process: the folder's shards are read back whole, without a process group."""
    accuracy, state, optim = single_loads(chain["folder"])
    assert accuracy == chain["fsdp"]["metrics"]["val_accuracy"]
    assert len(optim["state"]) == len(state), "momentum buffers came back, one per parameter"


@pytest.mark.distributed
def test_consolidate_to_one_file_that_single_loads(chain):
    from stratbench.checkpoints import checkpoint

    out = chain["root"] / "consolidated.pt"
    cli("consolidate", chain["folder"], out)
    full = checkpoint.load_file(out)  # weights_only: a plain full checkpoint
    assert full["layout"] == "full" and full["progress"]["step"] == 10
    folder_state = checkpoint.load_any(chain["folder"])
    assert full["model"].keys() == folder_state["model"].keys()
    assert all(torch.equal(full["model"][k], folder_state["model"][k]) for k in full["model"])
    accuracy, state, _ = single_loads(out)
    assert accuracy == chain["fsdp"]["metrics"]["val_accuracy"]
    assert all(torch.equal(state[k], full["model"][k]) for k in state)


@pytest.mark.distributed
def test_fsdp_resumes_on_another_world_size(chain):
    """Saved sharded over 2 ranks, resumed by fsdp on 1 rank: DCP re-splits every tensor for the new mesh."""
    ref = chain["ref"]["metrics"]["loss_curve"]
    res = train(chain["root"] / "fsdp1rank", "--strategy", "fsdp", *EQUIV, "--resume-from", str(chain["folder"]), nproc=1)
    assert res["world_size"] == 1 and res["resumed_from"]["step"] == 10
    assert_curves_match(res["metrics"]["loss_curve"], ref[10:], RTOL)
