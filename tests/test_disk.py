"""A node's disk against the checkpoints still to come (train/disk.py): said at the first save that shows it will fill,
stopped cleanly before a save that cannot fit, and rotated on every node's own disk."""

import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import orch

from orchestrator.train import disk, schedule
from orchestrator.train.checkpoints import verify

MIB = 1024**2


@pytest.mark.unit
@pytest.mark.parametrize("args, saves", [
    ((0, 8, "steps", 1, 1, 0), [1, 2, 3, 4, 5, 6, 7, 8]),
    ((4, 10, "steps", 4, 1, 0), [8, 10]),  # and at the last step, as DefaultFlowCallback saves there
    ((10, 10, "steps", 4, 1, 0), []),
    ((0, 9, "epoch", 0, 3, 0), [3, 6, 9]),
    ((3, 10, "epoch", 0, 3, 0), [4, 7, 10]),
    ((0, 6, "best", 0, 1, 2), [2, 4, 6]),  # at most at every evaluation
    ((0, 6, "no", 2, 1, 2), []),
])  # fmt: skip
def test_the_saves_to_come_follow_transformers_schedule(args, saves):
    assert schedule.saves_after(*args) == saves


@pytest.mark.unit
def test_a_save_needs_its_whole_checkpoint_free_and_the_limit_frees_one_after_it():
    # 10 MiB checkpoints, 25 MiB free, one kept: without a limit the 3rd save does not fit; with save_total_limit=2
    # each save after the second writes the new one before the oldest goes, so every save fits
    assert disk.Disk(10 * MIB, 25 * MIB, 1, None).fills_at([2, 3, 4]) == 4
    assert disk.Disk(10 * MIB, 25 * MIB, 1, 2).fills_at([2, 3, 4, 5, 6]) is None
    assert disk.Disk(10 * MIB, 9 * MIB, 1, 1).fills_at([2]) == 2  # the next save itself
    said = disk.stop_words(1, 2, disk.Disk(10 * MIB, 9 * MIB, 1, None), "checkpoint-1")
    assert said.startswith("the save at step 2 needs ~10.0 MiB on node 1's disk, which has 9.0 MiB free: stopped "
                           "after checkpoint-1, complete")  # fmt: skip
    assert "give the nodes a larger disk" in said and "save_total_limit=" not in said  # no limit holds even one more
    said = disk.measured(1, disk.Path("out/checkpoint-2"), disk.Disk(96 * 1024 * MIB, 2 * 1024**4, 1, 2), [4, 6])
    assert said == ("[orch] node 1: checkpoint-2 takes 96.00 GiB on this node's disk (out: 2.00 TiB free); the 2 "
                    "save(s) to come to step 6 fit")  # fmt: skip
    said = disk.warning(0, disk.Path("out/checkpoint-1"), disk.Disk(10 * MIB, 25 * MIB, 1, None), [2, 3, 4], 4)
    assert "no save_total_limit keeps them all: the save at step 4 will not fit; set save_total_limit=2 (" in said


@pytest.mark.unit
def test_the_checkpoints_cadence_is_said_at_the_measured_rate_and_a_long_run_saving_nothing_is_warned():
    from orchestrator.launch.storage import unsaved_recovery

    said = schedule.cadence(100, 1100, "steps", [500, 1000, 1100], eta_s=10_000)  # 10 s a step
    assert said == ("[orch] checkpoints: the next at step 500 (~1h06m at this rate), then every 500 steps (~1h23m); a "
                    "failure or a preemption loses the steps since the last one")  # fmt: skip
    assert schedule.cadence(2, 8, "no", [], eta_s=30) == ""  # a short run saving nothing: nothing to say
    said = schedule.cadence(10, 1010, "no", [], eta_s=10_000)
    assert said.startswith("[orch] warning: save_strategy=no: nothing is saved before the final model at step 1010, "
                           "~2h46m from now; ") and said.endswith("(save_strategy=steps save_steps=180 saves about "
                                                                 "every 30 minutes at this rate)")  # fmt: skip
    said = schedule.share_words(100, 1000, 100, eval_s=600, per_step=6)  # 10 evaluations of 10 min, 100 min of steps
    assert said == ("[orch] warning: the evaluation at step 100 took 10m00s and 100 steps take 10m00s: the run's 10 "
                    "evaluations would take ~50% of it (~1h40m of ~3h20m); eval_steps=1000 keeps them near a tenth, or "
                    "evaluate on fewer rows")  # fmt: skip
    assert schedule.share_words(100, 1000, 100, eval_s=30, per_step=6) == ""  # 5 min of 105
    assert unsaved_recovery({"save_strategy": "steps"}, managed=True) == []
    assert "every recovery of the managed job trains again from step 0" in unsaved_recovery(
        {"save_strategy": "no"}, managed=True)[0]
    assert "a preemption of a spot node loses the whole run" in unsaved_recovery({"save_strategy": "no"}, False)[0]


@pytest.mark.e2e  # imports transformers' Trainer utilities (seconds)
def test_a_node_where_transformers_does_not_save_rotates_its_own_checkpoints(tmp_path):
    """transformers rotates only where it saves (world rank 0): another node's shards on its own disk stayed."""
    for step in (1, 2, 3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    state = SimpleNamespace(best_model_checkpoint=str(tmp_path / "checkpoint-1"))
    disk.rotate_here(SimpleNamespace(should_save=True, save_total_limit=2, output_dir=str(tmp_path)), state)
    assert len(list(tmp_path.iterdir())) == 4  # rank 0's node: transformers did it
    disk.rotate_here(SimpleNamespace(should_save=False, save_total_limit=2, output_dir=str(tmp_path)), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-4"]  # the best one is kept


@pytest.mark.unit
def test_a_bucket_mount_is_measured_where_its_checkpoints_really_land(tmp_path, monkeypatch):
    """SkyPilot's bucket mounts report the object store's space (rclone: 1 PiB), which a save never runs out of: a
    MOUNT_CACHED checkpoint passes through rclone's cache on this node's disk, whose space (with what the cache holds
    beyond its cap, which it evicts once uploaded) is the next save's, one checkpoint at a time; a bucket another FUSE
    client streams is not this node's disk at all."""
    ckpt = tmp_path / "bucket" / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"x" * 5000)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "home" / ".cache" / "rclone"
    cache.mkdir(parents=True)
    (cache / "held").write_bytes(b"y" * 8192)
    info = tmp_path / "mountinfo"
    root = "20 1 0:1 / / rw - ext4 /dev/root rw\n"
    info.write_text(root + f"21 20 0:2 / {tmp_path / 'bucket'} rw - fuse.rclone bucket: rw\n")
    cached = disk.measure(ckpt, 3, info)
    assert (cached.kept, cached.limit) == (1, 1) and cached.size >= 5000
    assert cached.where == f"rclone's cache at {cache} for the bucket at {tmp_path / 'bucket'}"
    free = __import__("shutil").disk_usage(cache).free
    assert free - 8192 <= cached.free <= free + 8192  # its free space: what it holds is under rclone's cap, kept
    assert cached.fills_at([8, 12]) is None and disk.Disk(cached.free + 1, cached.free, 1, 1).fills_at([8]) == 8
    line = disk.measured(0, ckpt, cached, [8])
    assert "checkpoint-4 takes " in line and f"(rclone's cache at {cache} for the bucket at " in line, line
    info.write_text(root + f"21 20 0:2 / {tmp_path / 'bucket'} rw - fuse.gcsfuse bucket rw\n")
    streamed = disk.measure(ckpt, 3, info)
    assert streamed.fills_at(list(range(10**4))) is None
    assert disk.measured(0, ckpt, streamed, [8]).endswith(
        f"(the bucket fuse.gcsfuse streams at {tmp_path / 'bucket'}: not this node's disk); the 1 save(s) to come to "
        "step 8 fit")  # fmt: skip
    info.write_text(root)
    assert disk.measure(ckpt, 3, info).where == "" and "on this node's disk (" in disk.measured(0, ckpt, disk.measure(
        ckpt, 3, info), [])  # fmt: skip


@pytest.mark.root  # a small tmpfs mounted
@pytest.mark.e2e
def test_a_disk_that_cannot_hold_the_next_checkpoint_stops_the_run_after_the_last_that_fit(project):
    """On a 4 MiB disk, 2 emulated nodes saving every step: the first save says which one will not fit (node 0: node 1
    shares its disk), every rank
    stops after the last complete checkpoint (before: `RuntimeError: basic_ios::clear: iostream error` from
    torch.save inside the save, a half-written checkpoint), and a rerun on a larger disk resumes from it."""
    where = project / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(where)], check=True)
    try:
        command = ("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "save_steps=1", "output_dir=disk/run")
        result = orch(*command, cwd=project)
        assert result.returncode == 1, result.stdout[-3000:]
        warned = re.search(r"^\(node0\) \[orch\] warning: node 0: checkpoint-1 takes [\d.]+ MiB on this node's disk "
                           r"\(disk/run: [\d.]+ MiB free\), 7 save\(s\) to come to step 8 and save_total_limit=2 keeps "
                           r"2: the save at step (\d) will not fit; ", result.stdout, re.M)  # fmt: skip
        assert warned, result.stdout[-3000:]
        assert "warning: node 1:" not in result.stdout  # it sees node 0's manifest: the same disk, said once
        last = int(warned.group(1)) - 1
        final = result.stdout.strip().splitlines()[-1]
        assert re.fullmatch(rf"\[orch\] failed after [\d.]+ s: node \d exited with code 1: RuntimeError: the save at "
                            rf"step {last + 1} needs ~[\d.]+ MiB on node 0's disk, which has [\d.]+ MiB free: stopped "
                            rf"after checkpoint-{last}, complete, which a rerun resumes from; .*", final), final
        kept = sorted(p.name for p in (where / "run").glob("checkpoint-*"))
        assert kept[-1] == f"checkpoint-{last}" and verify(where / "run" / kept[-1]) == "", kept
        subprocess.run(["mount", "-o", "remount,size=64M", str(where)], check=True)
        again = orch(*command, cwd=project)
        assert again.returncode == 0, again.stdout[-3000:]
        assert f"resuming from disk/run/checkpoint-{last}" in again.stdout and "warning: node" not in again.stdout
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.root  # a small tmpfs mounted
@pytest.mark.e2e
def test_a_checkpoint_through_rclones_cache_stops_before_the_cache_disk_would_cut_it(project, tmp_path):
    """SkyPilot's MOUNT_CACHED for real: rclone mounts a store (its local backend standing in for the bucket) with
    SkyPilot's cache flags, the cache on a 2.5 MiB disk under the run's ~/.cache/rclone. The mount says the store's
    space; a write the cache's disk cannot hold fails half written and reaches the store cut (measured: a 3 MB file
    through a 2 MB cache arrived as 1,040,384 bytes), and rclone evicts nothing under its 10 GB cap. The run measures
    the cache's disk at its first save and stops after it, complete in the store, before the second would be cut."""
    import slurm_cluster

    assert slurm_cluster.missing() == ""  # rclone and fuse3 (apt, as root), with the Slurm bed's packages
    home, store, bucket = tmp_path / "home", tmp_path / "store", project / "bucket"
    cache = home / ".cache" / "rclone"
    for folder in (cache, store, bucket):
        folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(cache)], check=True)
    try:
        subprocess.run(["rclone", "mount", f":local:{store}", str(bucket), "--daemon", "--daemon-wait", "10s",
                        "--vfs-cache-mode", "full", "--cache-dir", str(cache / "mount"), "--vfs-cache-max-size", "10G",
                        "--vfs-write-back", "1s", "--vfs-cache-poll-interval", "10s", "--config", "/dev/null"],
                       check=True, timeout=60)  # fmt: skip
        assert f" {bucket} " in Path("/proc/self/mountinfo").read_text() and "fuse.rclone" in Path(
            "/proc/self/mountinfo").read_text()  # fmt: skip
        env = {"HOME": str(home), "ORCH_CACHE_DIR": str(Path.home() / ".cache" / "orch")}  # the smoke artifacts kept
        result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "output_dir=bucket/run",
                      cwd=project, env=env)  # fmt: skip
        assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
        final = result.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"\[orch\] failed after [\d.]+ s: node 0 exited with code 1: RuntimeError: the save at "
                            r"step 8 needs ~[\d.]+ MiB on node 0's disk, which has [\d.]+ MiB free: stopped after "
                            r"checkpoint-4, complete, which a rerun resumes from; .*", final), final  # fmt: skip
        time.sleep(3)  # rclone uploads a file a second after it closes
        assert sorted(p.name for p in (store / "run").glob("checkpoint-*")) == ["checkpoint-4"]
        assert verify(store / "run" / "checkpoint-4") == ""  # whole in the store, byte for byte
    finally:
        subprocess.run(["fusermount3", "-u", str(bucket)], check=False)
        subprocess.run(["umount", "-l", str(cache)], check=False)
    # nothing outlives it: rclone's daemon ends on its own after the unmount, once its write-back is done (a fresh
    # clone's run found it still there at once, under the suite's load)
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", f"rclone mount :local:{store}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "rclone's daemon outlived its unmount by 30 s"
        time.sleep(0.2)
