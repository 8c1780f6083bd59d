"""``FeederLoader`` over a mix of datasets: the classes of the union, keys ``NAME/key``,
each dataset's share of every epoch and batch, resumes at the same or another world
size and batch size, bad input refused with one line when the loader is built, a
state of another mix refused, a pool member lacking a dataset left with one line."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from clients import FeederLoader, merge_states
from core.errors import ConfigError
from feeder.config import ServerConfig
from feeder.server import create_server
from launcher.daemon_process import DaemonProcess
from protocol.mix import Mix, epoch_draws
from tests.common.mixes import build_extra_shards, labels_by_key

UNION = ["n00000001", "n00000002", "n00000003", "n00000004", "x-heron", "x-wren"]
MIX = {"sample": 0.75, "extra": 0.25}
_KW = dict(image_size=16, normalize=False, return_keys=True, seed=3)


@pytest.fixture(scope="module")
def extra(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_extra_shards(tmp_path_factory.mktemp("extra"))


@pytest.fixture(scope="module")
def mixed_daemon(shards: Path, extra: Path) -> Iterator[str]:
    server, port = create_server(ServerConfig.of(datasets={"sample": shards, "extra": extra}, port=0, device="cpu",
                                              threads=1, max_batch_size=64, grace_s=0.5))
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


@pytest.fixture(scope="module")
def truth(shards: Path, extra: Path) -> dict[str, int]:
    return labels_by_key(shards, "sample", UNION) | labels_by_key(extra, "extra", UNION)


def _epoch(loader: FeederLoader) -> list[tuple[str, int]]:
    return [(key, int(label)) for _, labels, keys in loader for key, label in zip(keys, labels)]


def test_a_mixed_loader_yields_each_datasets_share_with_labels_over_the_union(mixed_daemon, truth):
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, epoch_samples=64, rank=0, world_size=1, **_KW) as loader:
        assert loader.classes == UNION and loader.num_samples == 64 and len(loader) == 8
        assert loader.epoch_counts == {"sample": 48, "extra": 16} and loader.dataset_name == "sample+extra"
        batches = [(list(keys), labels.tolist()) for _, labels, keys in loader]
    assert len(batches) == 8
    for keys, labels in batches:
        assert sum(k.startswith("extra/") for k in keys) == 2  # a quarter of every batch of 8
        assert [truth[k] for k in keys] == labels


def test_the_default_epoch_is_every_sample_of_the_mix_once_in_proportion(mixed_daemon, truth):
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, rank=0, world_size=1, last_batch="pad",
                      return_padding=True, **_KW) as loader:
        assert loader.num_samples == len(truth) and loader.epoch_counts == {"sample": 114, "extra": 38}
        got = Counter(k.split("/")[0] for _, _, keys, pad in loader for k, p in zip(keys, pad) if not p)
    assert got == {"sample": 114, "extra": 38}


@pytest.mark.parametrize("dataset,kwargs,line", [
    ({"sample": 0.75, "extra": 0.0}, {}, "dataset: the weight of 'extra' is 0.0, not a positive finite number"),
    ({"sample": -1, "extra": 1}, {}, "dataset: the weight of 'sample' is -1,"),
    ({"sample": math.nan, "extra": 1}, {}, "dataset: the weight of 'sample' is nan,"),
    ({"sample": math.inf, "extra": 1}, {}, "dataset: the weight of 'sample' is inf,"),
    ({"sample": True, "extra": 1}, {}, "dataset: the weight of 'sample' is True,"),
    ({}, {}, "dataset: expected a name or a mapping"),
    ({"sample": 0.5, "extra": 0.5}, {"epoch_samples": 0}, "epoch_samples: must be an integer of 1 or more, got 0"),
    ({"sample": 0.5, "extra": 0.5}, {"epoch_samples": -4}, "epoch_samples: must be an integer of 1 or more"),
])
def test_bad_mixes_are_refused_before_connecting(dataset, kwargs, line):
    # No daemon listens there: the refusal comes before any connection.
    with pytest.raises(ConfigError) as caught:
        FeederLoader(dataset, address="127.0.0.1:9", connect_timeout_s=0.5, **kwargs)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


@pytest.mark.parametrize("dataset,split,line", [
    ({"sample": 0.5, "nope": 0.5}, "train", "dataset: daemon 127.0.0.1:{port} does not serve dataset 'nope'"),
    (MIX, "val", "dataset: daemon 127.0.0.1:{port}: dataset 'extra' has no split 'val'"),
])
def test_a_mix_of_datasets_or_splits_the_daemon_lacks_is_refused_when_built(mixed_daemon, dataset, split, line):
    with pytest.raises(ConfigError) as caught:
        FeederLoader(dataset, address=mixed_daemon, split=split, **_KW)
    assert str(caught.value).startswith(line.format(port=mixed_daemon.rsplit(":", 1)[1]))


def test_a_dataset_its_weight_gives_no_sample_of_an_epoch_is_refused_when_built(mixed_daemon):
    with pytest.raises(ConfigError) as caught:
        FeederLoader({"sample": 1, "extra": 0.001}, address=mixed_daemon, batch_size=8, rank=0, world_size=1,
                     epoch_samples=48, **_KW)
    assert str(caught.value) == ("mix[1].weight: 0.001 gives 'extra' no sample of an epoch of 48 (epoch_samples), "
                                 "so it would never be read: raise its weight or the epoch's length")


def test_numpy_and_other_real_weights_are_weights_in_the_loader_and_in_its_state(mixed_daemon):
    weights = {"sample": np.float32(0.75), "extra": Fraction(1, 4)}
    with FeederLoader(weights, address=mixed_daemon, batch_size=8, rank=0, world_size=1, epoch_samples=64,
                      **_KW) as loader:
        assert loader.epoch_counts == {"sample": 48, "extra": 16}
        next(iter(loader))
        state = loader.state_dict()
    state["mix"] = [[name, np.float32(weight)] for name, weight in state["mix"]]  # as a numpy round trip leaves it
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, rank=0, world_size=1, epoch_samples=64,
                      **_KW) as resumed:
        resumed.load_state_dict(state)
        assert resumed.position.cursor == 8
    with pytest.raises(ConfigError, match="^dataset: the weight of 'extra' is np.True_, not a positive"):
        FeederLoader({"sample": 1.0, "extra": np.bool_(True)}, address="127.0.0.1:9", connect_timeout_s=0.5)


def test_a_mix_longer_than_the_daemon_plans_is_refused_when_built_with_its_message(mixed_daemon):
    with pytest.raises(ConfigError) as caught:
        FeederLoader(MIX, address=mixed_daemon, batch_size=8, rank=0, world_size=1, epoch_samples=10**6, **_KW)
    assert str(caught.value).startswith("epoch_samples: 1000000 is over this daemon's limit of 16384 "
                                        "(--max-epoch-samples 16384, or the mix's datasets' 152 samples together")
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, rank=0, world_size=1, epoch_samples=16384,
                      **_KW) as loader:
        assert loader.num_samples == 16384


def test_a_state_of_another_mix_is_refused_with_one_line(mixed_daemon):
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, epoch_samples=64, rank=0, world_size=1, **_KW) as loader:
        state = loader.state_dict()
    assert state["mix"] == [["sample", 0.75], ["extra", 0.25]] and state["epoch_samples"] == 64
    with FeederLoader({"sample": 0.5, "extra": 0.5}, address=mixed_daemon, batch_size=8, epoch_samples=64, rank=0,
                      world_size=1, **_KW) as other:
        with pytest.raises(ConfigError, match=r"^loader state is for mix=sample=0.75,extra=0.25, this loader has "
                                              r"sample=0.5,extra=0.5$"):
            other.load_state_dict(state)
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, epoch_samples=80, rank=0, world_size=1, **_KW) as longer:
        with pytest.raises(ConfigError, match=r"^loader state is for epoch_samples=64, this loader has 80$"):
            longer.load_state_dict(state)
    with FeederLoader("sample", address=mixed_daemon, batch_size=8, rank=0, world_size=1, **_KW) as plain:
        with pytest.raises(ConfigError, match=r"^loader state is for dataset='sample\+extra'"):
            plain.load_state_dict(state)


def test_a_resume_at_the_same_world_size_and_another_batch_size_goes_on_at_the_next_sample(mixed_daemon):
    kwargs = dict(epoch_samples=64, world_size=1, rank=0, **_KW)
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, **kwargs) as loader:
        whole = [k for _, _, keys in loader for k in keys]
    with FeederLoader(MIX, address=mixed_daemon, batch_size=8, **kwargs) as loader:
        batches = iter(loader)
        first = [k for _ in range(3) for k in next(batches)[2]]
        state = loader.state_dict()
    with FeederLoader(MIX, address=mixed_daemon, batch_size=5, **kwargs) as resumed:
        resumed.load_state_dict(state)
        rest = [k for _, _, keys in resumed for k in keys]
    assert first + rest[:len(whole) - 24] == whole  # drop: the new batch size's tail is left out


def test_a_pool_member_lacking_a_dataset_of_the_mix_is_left_with_one_line(mixed_daemon, shards, caplog):
    caplog.set_level(logging.ERROR, logger="clients.pool")
    server, port = create_server(ServerConfig.of(datasets={"sample": shards}, port=0, device="cpu", threads=1,
                                              grace_s=0.5))
    lacking = f"127.0.0.1:{port}"
    try:
        with FeederLoader(MIX, address=[lacking, mixed_daemon], batch_size=8, epoch_samples=64, rank=0, world_size=1,
                          **_KW) as loader:
            keys = [k for _, _, batch in loader for k in batch]
            assert [m.left for m in loader._streams.pool.members] == [True, False]
    finally:
        server.stop(0).wait(10)
    assert len(keys) == 64
    lines = [r.getMessage() for r in caplog.records if lacking in r.getMessage()]
    assert len(lines) == 1 and "does not serve dataset 'extra'" in lines[0], lines


def test_merged_states_resume_a_mix_at_another_world_size(mixed_daemon):
    kwargs = dict(epoch_samples=64, last_batch="pad", return_padding=True, **_KW)
    with ExitStack() as stack:
        ranks = [stack.enter_context(FeederLoader(MIX, address=mixed_daemon, batch_size=4, rank=r, world_size=2,
                                                  **kwargs)) for r in range(2)]
        iters = [iter(r) for r in ranks]
        read = [k for it in iters for _ in range(3) for k, p in zip(*next(it)[2:]) if not p]
        job = merge_states([r.state_dict() for r in ranks])
    with ExitStack() as stack:
        ranks = [stack.enter_context(FeederLoader(MIX, address=mixed_daemon, batch_size=3, rank=r, world_size=3,
                                                  **kwargs)) for r in range(3)]
        for r in ranks:
            r.load_state_dict(job)
        read += [k for r in ranks for _, _, keys, pad in r for k, p in zip(keys, pad) if not p]
    assert Counter(k.split("/")[0] for k in read) == {"sample": 48, "extra": 16}
    assert len(set(read)) == 64  # 48 of sample's 128 and 16 of extra's 24: one pass each, every sample once


# -- the whole story: 3 epochs, 2 ranks resumed mid-epoch at 3, a daemon of the pool killed --


def _epoch_of_ranks(ranks: list[FeederLoader], epoch: int, phase: str, out: list[dict], kill=None,
                    steps: int | None = None) -> None:
    """Every rank's batches of ``epoch`` (``steps`` of them if given), rank after rank
    at each step as ranks in step take them, recorded in ``out``; ``kill()`` after the
    third step."""
    for rank in ranks:
        rank.set_epoch(epoch)
    live = {k: iter(rank) for k, rank in enumerate(ranks)}
    step = 0
    while live and (steps is None or step < steps):
        for k, batches in list(live.items()):
            batch = next(batches, None)
            if batch is None:
                del live[k]
                continue
            _, labels, keys, padding = batch
            out.append(dict(epoch=epoch, phase=phase, keys=list(keys), labels=labels.tolist(),
                            padding=padding.tolist()))
        step += 1
        if step == 3 and kill is not None:
            kill()


@pytest.mark.slow
def test_a_mix_resumed_at_3_ranks_through_a_daemon_killed_keeps_shares_passes_and_labels(shards, extra, truth,
                                                                                           caplog):
    caplog.set_level(logging.WARNING, logger="clients.pool")
    kwargs = dict(split="train", image_size=16, normalize=False, return_keys=True, return_padding=True, seed=5,
                  last_batch="pad", pool_stall_timeout_s=1.5)
    out: list[dict] = []
    with ExitStack() as stack:
        daemons = [stack.enter_context(DaemonProcess({"sample": shards, "extra": extra}, ("--threads", "1")))
                   for _ in range(2)]
        addresses = [d.address for d in daemons]
        two = [stack.enter_context(FeederLoader(MIX, address=addresses, rank=r, world_size=2, batch_size=6, **kwargs))
               for r in range(2)]
        killed: list[int] = []
        _epoch_of_ranks(two, 0, "2 ranks", out, kill=lambda: killed.append(daemons[1].kill()))
        _epoch_of_ranks(two, 1, "2 ranks", out, steps=4)
        job = merge_states([r.state_dict() for r in two])
        for rank in two:
            rank.close()
        # The killed daemon is still in the pool: probed in the background, never answering.
        three = [stack.enter_context(FeederLoader(MIX, address=addresses, rank=r, world_size=3, batch_size=4,
                                                  connect_timeout_s=2.0, **kwargs)) for r in range(3)]
        for rank in three:
            rank.load_state_dict(job)
        _epoch_of_ranks(three, 1, "3 ranks, resumed", out)
        _epoch_of_ranks(three, 2, "3 ranks", out)
    # The fault took place, and the ranks saw it.
    assert killed == [-9]
    assert any(daemons[1].address in r.getMessage() and "of the pool failed" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    mix = Mix((128, 24), (0.75, 0.25), 152)
    assert mix.counts == (114, 38)
    keys = {name: [k for k in truth if k.startswith(f"{name}/")] for name in ("sample", "extra")}  # in index order
    real = [(b["epoch"], k) for b in out for k, p in zip(b["keys"], b["padding"]) if not p]
    for epoch in range(3):  # each dataset exactly its count, exactly the plan's draws of its passes
        got = Counter(k for e, k in real if e == epoch)
        draws = epoch_draws(mix, 5, epoch, shuffle=True)
        want = Counter([keys["sample"][i] for i in draws[0]] + [keys["extra"][i] for i in draws[1]])
        assert got == want, f"epoch {epoch}"
        assert Counter(k.split("/")[0] for k in got.elements()) == {"sample": 114, "extra": 38}
    # No sample twice within a pass of its dataset: 342 of sample's 128 (two passes and 86),
    # 114 of extra's 24 (four passes and 18).
    seen = Counter(k for _, k in real)
    assert sorted(Counter(n for k, n in seen.items() if k.startswith("sample/")).items()) == [(2, 42), (3, 86)]
    assert sorted(Counter(n for k, n in seen.items() if k.startswith("extra/")).items()) == [(4, 6), (5, 18)]
    share = 38 / 152
    for batch in out:  # every batch within the share bound; every label the right one
        flags = [k.startswith("extra/") for k, p in zip(batch["keys"], batch["padding"]) if not p]
        bound = 2 if batch["phase"] == "3 ranks, resumed" else 1
        assert abs(sum(flags) - len(flags) * share) < bound, batch
        assert [truth[k] for k in batch["keys"]] == batch["labels"]
