"""megalite runs on the torch its GPU machines have (2.11) as on the pinned one (2.13): the collectives torch 2.13
renamed are taken under either name."""

import importlib.util

import torch.distributed as dist

import megalite.tensor_parallel.comm as comm


def test_comm_takes_the_single_tensor_collectives_under_their_older_names(monkeypatch):
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)  # as in torch 2.11
    spec = importlib.util.spec_from_file_location("comm_on_older_torch", comm.__file__)
    older = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(older)  # a separate copy: the loaded module stays as it is
    assert older.all_gather_single is dist.all_gather_into_tensor
    assert older.reduce_scatter_single is dist.reduce_scatter_tensor
