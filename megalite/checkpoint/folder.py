"""The checkpoint folder protocol: a save is staged in `iter_0000100.tmp-new/`, moved into place and
only then named in `latest_checkpointed_iteration.txt`, each step fsynced, so a crash leaves the latest
file naming a complete checkpoint. Also: choosing what to resume from, and removing old checkpoints."""

import contextlib
import os
import shutil

from megalite.checkpoint.format import file_problem, read_metadata
from megalite.errors import UserError

LATEST_FILE = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".tmp-new"  # a save in progress (or killed mid-way)
REPLACED_SUFFIX = ".tmp-old"  # the previous copy of an iteration being saved again
DELETING_SUFFIX = ".tmp-del"  # an old checkpoint being removed (--keep-last-n-checkpoints)


def checkpoint_dir(save: str, iteration: int) -> str:
    """`<save>/iter_0000100`: Megatron's folder name, the iteration zero-padded to 7 digits."""
    return os.path.join(save, f"iter_{iteration:07d}")


def read_latest_iteration(load: str) -> int | None:
    """The iteration in `<load>/latest_checkpointed_iteration.txt`, None without that file;
    UserError when it holds anything but a non-negative integer."""
    path = os.path.join(load, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as file:
        text = file.read(200).decode("utf-8", errors="replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"{path} should hold an iteration number but holds {text[:40]!r}; write the number of "
                        f"a complete iter_* folder into it, or delete it to start from scratch")
    return int(text)


def create_staging(save: str, staging: str) -> None:
    """Remove the `*.tmp-*` leftovers of killed saves from `save` (created if needed), first restoring
    an iteration caught mid-replace; then create the empty `staging` folder."""
    os.makedirs(save, exist_ok=True)
    for name in sorted(os.listdir(save)):
        path = os.path.join(save, name)
        if name.endswith(REPLACED_SUFFIX) and not os.path.exists(path[:-len(REPLACED_SUFFIX)]):
            # Killed between moving the old copy away and moving the new one in: the old copy is
            # the complete checkpoint the latest file names.
            os.rename(path, path[:-len(REPLACED_SUFFIX)])
        elif name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX, DELETING_SUFFIX)) and os.path.isdir(path):
            shutil.rmtree(path)
        elif name == LATEST_FILE + ".tmp":
            os.remove(path)
    fsync_dir(save)
    os.makedirs(staging)


def move_into_place(staging: str, final: str) -> None:
    """Rename `staging` to `final`; an existing `final` (the same iteration saved again) is replaced."""
    replaced = final + REPLACED_SUFFIX
    existed = os.path.exists(final)
    if existed:
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_dir(os.path.dirname(final) or ".")
    if existed:
        shutil.rmtree(replaced)


def write_latest(save: str, iteration: int) -> None:
    """Replace the latest file atomically: a reader sees the old number or the new one."""
    path = os.path.join(save, LATEST_FILE)
    temporary = path + ".tmp"
    try:
        with open(temporary, "w") as file:
            file.write(str(iteration))  # Megatron's content: the number, no newline
            file.flush()
            os.fsync(file.fileno())
    except OSError:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    os.replace(temporary, path)
    fsync_dir(save)


def fsync_file(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_dir(path: str) -> None:
    """Make renames and new entries in `path` durable (a no-op where directories cannot be fsynced)."""
    with contextlib.suppress(OSError):
        fsync_file(path)


def resolve_checkpoint(load: str, iteration: int | None = None) -> str:
    """The folder to load: `iteration`'s, else the latest file's. UserError when it does not exist."""
    if not os.path.isdir(load):
        raise UserError(f"--load directory {load} does not exist; check the path")
    if iteration is None:
        iteration = read_latest_iteration(load)
        if iteration is None:
            raise UserError(f"{load} has no {LATEST_FILE}, so it holds no complete checkpoint; "
                            f"check --load, or drop it to start from scratch")
    path = checkpoint_dir(load, iteration)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + REPLACED_SUFFIX):
        return path + REPLACED_SUFFIX  # a save of the same iteration was killed mid-replace
    raise UserError(f"checkpoint folder {path} for iteration {iteration} does not exist; "
                    f"restore it, or fix {os.path.join(load, LATEST_FILE)}")


def complete_checkpoints(load: str) -> list[tuple[int, str]]:
    """(iteration, folder) of every complete `iter_*` checkpoint in `load`, newest first: its
    metadata.json reads and every file it needs has its recorded size."""
    found = []
    for name in os.listdir(load) if os.path.isdir(load) else []:
        number = name[len("iter_"):]
        if not (name.startswith("iter_") and number.isascii() and number.isdigit()):
            continue
        path = os.path.join(load, name)
        try:
            if file_problem(path, read_metadata(path)) is None:
                found.append((int(number), path))
        except (UserError, OSError, KeyError, TypeError):
            continue
    return sorted(found, reverse=True)


def choose_checkpoint(load: str) -> tuple[str | None, str | None]:
    """The folder to resume from in `load` and a note when it is not the latest file's (then the newest
    complete checkpoint at or below the named iteration, else the newest); (None, None) if there is none."""
    try:
        latest, garbled = read_latest_iteration(load), None
    except UserError as error:
        latest, garbled = None, str(error)
    if latest is not None:
        try:
            path = resolve_checkpoint(load, latest)
            problem = file_problem(path, read_metadata(path))
        except UserError as error:
            problem = str(error)
        if problem is None:
            return path, None
    complete = complete_checkpoints(load)
    if not complete:
        if latest is not None or garbled:
            raise UserError(f"{load} holds no complete checkpoint: {garbled or problem}; restore a checkpoint "
                            f"folder, or delete {os.path.join(load, LATEST_FILE)} to start from scratch")
        return None, None
    older = [entry for entry in complete if latest is None or entry[0] <= latest]
    iteration, path = (older or complete)[0]
    why = garbled or (f"{LATEST_FILE} names iteration {latest}, which is incomplete ({problem})"
                      if latest is not None else f"{LATEST_FILE} is missing")
    return path, f"{why}; resuming from the newest complete checkpoint instead, iteration {iteration}"


def remove_old_checkpoints(save: str, keep_last: int, retain_interval: int | None, keep: set[int]) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep_last`, except the latest file's, multiples of
    `retain_interval` and `keep`; return the folders removed. Each is renamed to `*.tmp-del` first, so a
    kill never leaves a half-deleted `iter_*`."""
    try:
        latest = read_latest_iteration(save)
    except UserError:
        return []  # without a trustworthy latest file nothing is deleted
    removed = []
    for iteration, path in complete_checkpoints(save)[keep_last:]:
        if iteration == latest or iteration in keep or (retain_interval and iteration % retain_interval == 0):
            continue
        doomed = path + DELETING_SUFFIX
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_dir(save)
    return removed
