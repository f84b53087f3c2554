"""ScheduleRunner runs any model and any loss given from outside: two pipeline stages of plain linear layers,
a mean-squared error on micro-batches with their own keys, in one process (a thread per rank)."""

import threading
from types import SimpleNamespace

import torch
from torch import nn

from megalite.pipeline_parallel.schedules import ScheduleRunner, schedule_steps


class ThreadComm:
    """PipelineComm's exchange between threads of one process: sends go to a shared mailbox."""

    def __init__(self, rank: int, mailbox: dict, ready: threading.Condition):
        self.parallel = SimpleNamespace(pp_size=2, pp_rank=rank)
        self.mailbox, self.ready = mailbox, ready

    def exchange(self, sends, recvs) -> dict:
        with self.ready:
            self.mailbox.update((message, tensor.clone()) for message, tensor in sends)
            self.ready.notify_all()
            self.ready.wait_for(lambda: all(message in self.mailbox for message in recvs), timeout=30)
            return {message: self.mailbox.pop(message) for message in recvs}


class Unscaled:
    @staticmethod
    def scale_loss(loss):
        return loss


def forward_step(chunk, micro_batch, hidden_states):
    return chunk(micro_batch["x"] if hidden_states is None else hidden_states)


def mse(chunk, output, micro_batch):
    return 0.5 * (output - micro_batch["target"]).square()


def test_a_custom_model_and_loss_run_through_a_two_stage_schedule():
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 4)]
    micro_batches = [{"x": torch.randn(3, 4), "target": torch.randn(3, 4)} for _ in range(4)]
    total = 12.0
    with torch.no_grad():
        reference = sum(mse(None, stages[1](stages[0](mb["x"])), mb).sum() / total for mb in micro_batches)
    mailbox, ready, losses, errors = {}, threading.Condition(), {}, []

    def rank_main(rank):
        try:
            runner = ScheduleRunner([stages[rank]], micro_batches, total, forward_step, mse,
                                    ThreadComm(rank, mailbox, ready), Unscaled.scale_loss)
            losses[rank] = runner.run(schedule_steps(2, 1, len(micro_batches), rank))
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert losses[0] is None and not mailbox
    torch.testing.assert_close(losses[1].float(), reference)
    grads = [param.grad.clone() for stage in stages for param in stage.parameters()]
    for stage in stages:
        stage.zero_grad()
    sum(mse(None, stages[1](stages[0](mb["x"])), mb).sum() / total for mb in micro_batches).backward()
    for grad, param in zip(grads, [param for stage in stages for param in stage.parameters()]):
        torch.testing.assert_close(grad, param.grad)
