"""Checkpoint files kept in host memory between a stage's turns (stagekit/host_copy.py): reading the copy gives exactly
the tensors (and the loaded DiT exactly the weights) that reading the file gives; the copy is a memfd that nothing
outlives (release, stop, kill -9); a host short of memory falls back to reading the files; Status says which."""

import gc
import os
import signal
from pathlib import Path

import grpc
import pytest
import torch

from client.progress import print_status
from dit_svc.engine import embedded_config
from h3.v1 import common_pb2
from minimax_h3.dit.checkpoint import load_dit_weights
from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
from minimax_h3.kernels.int8 import QuantizedWeight
from minimax_h3.vae.video import load_video_vae, write_tiny_video_vae
from render_svc.stage_calls import sample
from stagekit import host_copy
from stagekit import checkpoints
from stagekit.checkpoints import TensorReader, WeightSource, open_checkpoint, prefault_copies
from stagekit.device_worker import WORKER_ENV
from stagekit.host_copy import GIB, HOST_RESERVE_BYTES, MEM_AVAILABLE_ENV, HostCopies, decide
from tests.conftest import SERVER_ENV
from tests.procs import alive, descendants, open_paths
from tests.test_device_worker import SPEC, TEXT, clients, start, workers
from tests.test_dit_checkpoint import assert_same_weights
from tests.waits import wait_until

ROOMY = str(64 * GIB)   # MemAvailable as the stages see it (injected): a 64 GB desktop at rest
SHORT = str(8 * GIB)    # a host that cannot keep a copy beside the reserve


def memfds(pid: int) -> list[str]:
    return [p for p in open_paths(pid) if p.startswith("/memfd:h3-")]


def from_copies(copies: HostCopies, files: list[Path | str]) -> WeightSource:
    """What a device worker's load reads: `files`, from the copies the stage holds (made now where missing)."""
    return WeightSource.host_copies(files, copies.ensure(files), {})


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory) -> Path:
    cfg = DiTConfig.tiny(num_layers=2)
    return write_tiny_checkpoint(cfg, tmp_path_factory.mktemp("dit") / "dit_int8.safetensors", "int8_convrot_pruned")


def test_decision_keeps_the_reserve():
    assert decide(10 * GIB, 10 * GIB + HOST_RESERVE_BYTES).kept
    short = decide(10 * GIB, 10 * GIB + HOST_RESERVE_BYTES - 1)
    assert not short.kept and "not kept" in short.describe() and "would leave" in short.reason()


def test_reading_the_copy_gives_the_files_tensors_and_release_leaves_nothing(int8_file, monkeypatch):
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    copies = HostCopies("test")
    mapping = copies.ensure([int8_file])
    assert list(mapping) == [str(int8_file.resolve())] and copies.choice.kept
    assert len(memfds(os.getpid())) == 1
    entries = open_checkpoint(int8_file).tensors
    disk = TensorReader(entries)
    expect = {k: disk.whole(k) for k in entries}
    src = WeightSource.host_copies([int8_file], mapping, {})
    copy, views = TensorReader(entries, source=src), TensorReader(entries, source=src, views=True)
    for k, t in expect.items():
        assert torch.equal(copy.whole(k), t) and copy.whole(k).dtype == t.dtype, k
        v = views.whole(k)
        assert torch.equal(v, t) and torch.equal(src.to_device(v, "cpu"), t), k
        if t.ndim == 2 and t.shape[0] > 2 and t.shape[1] > 2:
            assert torch.equal(copy.rows(k, 1, 3), t[1:3]) and torch.equal(copy.cols(k, 1, 3), t[:, 1:3]), k
    assert copies.ensure([int8_file]) == mapping, "a second turn reuses the copy"
    del v, copy, views, src
    gc.collect()
    assert len(memfds(os.getpid())) == 1, "the reader's mapping goes with its last view"
    copies.release()
    assert memfds(os.getpid()) == []


def test_prefaulted_copies_read_the_same_and_a_copy_made_again_is_mapped_again(int8_file, monkeypatch):
    """What a standby worker does (`prefault_copies`): map the copies and fault them in ahead of the turn. The load
    then reads the same tensors from that mapping; a copy made again (its file changed) under a reused descriptor
    number is a new memfd: it is mapped anew and the prefault stops, the stale mapping is never read."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    entries = open_checkpoint(int8_file).tensors
    expect = {k: TensorReader(entries).whole(k) for k in entries}
    copies = HostCopies("test")
    try:
        mapping = copies.ensure([int8_file])
        pre = prefault_copies(mapping)
        pre.thread.join(timeout=30)
        (mapped,) = pre.mapped.values()
        src = WeightSource.host_copies([int8_file], mapping, {}, pre)  # the same copies: the prefaulted mapping
        assert list(src.copies.values()) == [mapped] and not pre.stop.is_set()
        views = TensorReader(entries, source=src, views=True)
        assert all(torch.equal(views.whole(k), t) for k, t in expect.items())
        del views, src
        copies.release()
        src = WeightSource.host_copies([int8_file], copies.ensure([int8_file]), {}, pre)
        (remapped,) = src.copies.values()
        assert remapped is not mapped and remapped.ino != mapped.ino and pre.stop.is_set()
        views = TensorReader(entries, source=src, views=True)
        assert all(torch.equal(views.whole(k), t) for k, t in expect.items())
        del views, mapped, remapped, src, pre
    finally:
        copies.release()


def test_a_host_short_of_memory_reads_the_files(int8_file, monkeypatch):
    monkeypatch.setenv(MEM_AVAILABLE_ENV, SHORT)
    copies = HostCopies("test")
    assert copies.ensure([int8_file]) == {} and not copies.choice.kept
    assert memfds(os.getpid()) == []
    op, kept, why = copies.status_row()
    assert op == "host copy" and kept.startswith("not kept") and "8.0 GiB" in why


def test_loaded_dit_weights_from_the_copy_are_bitwise_the_files(int8_file, monkeypatch):
    """The loader's staged path (views of the copy, cast after the move) against today's (read, cast, move)."""
    cfg = DiTConfig.tiny(num_layers=2, adaln_form="curve")
    for dtype in (torch.float16, torch.float32):
        disk = load_dit_weights(int8_file, cfg, dtype=dtype)
        monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
        copies = HostCopies("test")
        try:
            staged = load_dit_weights(int8_file, cfg, dtype=dtype, workers=2, source=from_copies(copies, [int8_file]))
        finally:
            copies.release()
        assert_same_weights(disk, staged)
        for t in staged.values():  # a loaded tensor is its own memory, never the (read-only) copy
            (t.qdata if isinstance(t, QuantizedWeight) else t).add_(1)


def _status_row(c, stage: str) -> tuple[str, str]:
    st = c.stub(stage).Status(common_pb2.StatusRequest(), timeout=10)
    (row,) = [k for k in st.kernels if k.op == "host copy"]
    return row.kernel, row.reason


def test_stage_with_copy_gives_the_same_bits_and_nothing_outlives_it(tmp_path, model_cache):
    """Through real DiT stages on CPU (the worker path): one keeping its file in host memory, one on a host short of
    memory. Same latents; Status says which; the copy lives in the stage process and dies with it, kill -9
    included; from the second turn on, the next turn's worker maps it while it waits on standby."""
    kept = start("dit", 1, tmp_path / "kept", model_cache, {**SERVER_ENV, WORKER_ENV: "1", MEM_AVAILABLE_ENV: ROOMY})
    short = start("dit", 1, tmp_path / "short", model_cache, {**SERVER_ENV, WORKER_ENV: "1", MEM_AVAILABLE_ENV: SHORT})
    try:
        with clients(kept, "dit") as c:
            assert _status_row(c, "dit")[0] == "decided at the first load"
            v, a, _ = sample(c, SPEC, TEXT, timeout_s=120)
            kernel, reason = _status_row(c, "dit")
            assert kernel.startswith("kept in host memory") and "64.0 GiB" in reason
            c.stub("dit").Unload(common_pb2.UnloadRequest(), timeout=60)
            # The next turn's worker maps the copy on standby (and faults it in), before any lease.
            (standby,) = workers(kept, "dit")
            wait_until(lambda: any("memfd:h3-dit" in line for line in Path(f"/proc/{standby}/maps").read_text()
                                   .splitlines()), what="the standby worker to map the host copy")
            v2, a2, _ = sample(c, SPEC, TEXT, timeout_s=120)  # the second turn loads from the copy
        with clients(short, "dit") as c:
            sv, sa, _ = sample(c, SPEC, TEXT, timeout_s=120)
            assert _status_row(c, "dit")[0].startswith("not kept")
        assert torch.equal(v, sv) and torch.equal(a, sa) and torch.equal(v, v2) and torch.equal(a, a2)
        stage = kept.procs["dit"].pid
        assert len(memfds(stage)) == 1 and memfds(short.procs["dit"].pid) == []
        family = [stage, *workers(kept, "dit")]
        os.kill(stage, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in family), what="the stage and its standby worker to go")
        assert not [p for p in os.listdir("/dev/shm") if p.startswith("h3-")]
        others = [short.procs["dit"].pid, *descendants(short.procs["dit"].pid)]
    finally:
        kept.stop()
        short.stop()
    wait_until(lambda: not any(alive(p) for p in others), what="a stopped stage's processes (standby included) to go")


def test_video_vae_from_the_copy_is_bitwise_the_files(tmp_path, monkeypatch):
    """The video VAE loader's staged path (threads, views of the copy, cast after the move) against the file's."""
    path = str(tmp_path / "vae.safetensors")
    write_tiny_video_vae(path)
    disk = load_video_vae(path, dtype=torch.float16, parts="decoder").state_dict()
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    copies = HostCopies("test")
    try:
        staged = load_video_vae(path, dtype=torch.float16, parts="decoder",
                                source=from_copies(copies, [path])).state_dict()
    finally:
        copies.release()
    assert staged.keys() == disk.keys()
    assert all(staged[k].dtype == v.dtype and torch.equal(staged[k], v) for k, v in disk.items())


def test_a_derived_copy_is_kept_only_once_a_load_filled_it(int8_file, monkeypatch):
    """Derived copies (what a load computes from the files): offered empty until a load has filled it and the stage
    marked it; then mapped with the file copies, read back bit for bit; gone with its file's copy."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    key = checkpoints.derived_key(int8_file, "int8 linears from float16")
    made = {"a.weight": torch.randint(-128, 127, (5, 64), dtype=torch.int8),
            "a.weight_scale": torch.rand(5, 1), "a.groupsize": torch.tensor([16])}
    copies = HostCopies("test")
    try:
        mapping = copies.ensure([int8_file], {key: 1000})
        to_fill = copies.to_fill([key])
        assert key not in mapping and list(to_fill) == [key] and len(memfds(os.getpid())) == 2
        src = WeightSource.host_copies([int8_file], mapping, to_fill)
        assert src.derived(key) is None
        assert src.fill(key, made) and src.filled == [key]
        # A load that failed after writing (the stage never marks it): the next turn is offered it again.
        assert key not in copies.ensure([int8_file], {key: 1000}) and copies.to_fill([key]) == to_fill
        copies.filled([key])
        mapping = copies.ensure([int8_file], {key: 1000})
        assert copies.to_fill([key]) == {} and mapping[key] == to_fill[key]
        assert copies.held([int8_file]) == mapping, "the standby worker maps it too"
        src = WeightSource.host_copies([int8_file], mapping, {})
        got = src.derived(key)
        assert src.fill(key, made) is False, "nothing offered: nothing written"
        assert got.keys() == made.keys()
        for k, t in made.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        del got, src
        os.utime(int8_file)  # the file changed on disk: its copy and what was derived from it go
        copies.ensure([int8_file], {key: 1000})
        assert list(copies.to_fill([key])) == [key]
    finally:
        copies.release()
    gc.collect()
    assert memfds(os.getpid()) == []


def test_a_dit_whose_kernel_converts_linears_keeps_them_and_loads_the_same_bits(int8_file, monkeypatch, tmp_path):
    """The int8 kernel serves the token refiner, which the file stores in bf16: the first turn converts it and fills
    the stage's derived copy, the next turn copies it instead of converting, and the model is bitwise the same."""
    pytest.importorskip("comfy_kitchen")
    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from minimax_h3.kernels.registry import KernelSelection, default_attention_candidates, default_linear_candidates
    from stagekit.dist import RankGroup, RankInfo

    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    sel = KernelSelection(torch.device("cpu"), "cpu", "int8", "math", [], {}, default_linear_candidates(),
                          default_attention_candidates(), torch.float32)
    cfg = DiTEngineConfig(str(int8_file), "", tmp_path, "cpu", torch.float32, kernels=sel)
    eng = DiTEngine(cfg, RankGroup(RankInfo(0, 1, 0), "gloo", 60))
    files = eng.weight_files()
    derived = eng.derived_copies(files)
    ((key, nbytes),) = derived.items()
    refiner = list(eng._conversions(eng.partitions[eng.partition]))
    assert refiner and all(n.startswith("token_refiner.") for n in refiner)
    copies = HostCopies("dit")
    states = []
    try:
        for turn in range(2):
            mapping = copies.ensure(list(files), derived)
            src = WeightSource.host_copies(files, mapping, copies.to_fill(list(derived)))
            eng.load(src)
            phases = eng.load_phases
            assert phases["kept_conversions"] == (0 if turn == 0 else len(refiner))
            assert (phases["assembly_convert"] > 0) == (turn == 0)
            assert src.filled == ([key] if turn == 0 else [])
            copies.filled(src.filled)
            states.append({k: v.clone() for k, v in eng.model.state_dict().items()})
            eng.unload()
        assert copies.nbytes - sum(f.stat().st_size for f in files) <= nbytes + 4096
    finally:
        copies.release()
    assert states[0].keys() == states[1].keys()
    for k, t in states[0].items():
        assert t.dtype == states[1][k].dtype and torch.equal(t, states[1][k]), k


def rewrite_keeping_size_and_mtime(path: Path, new: Path) -> None:
    """What `cp -p new path` does to a file a stage holds a copy of: new bytes of the same size written into the same
    inode, then the old atime and mtime set back (`rsync -a`, `tar x` and `touch -r` leave the same size and mtime)."""
    old = path.stat()
    data = new.read_bytes()
    assert len(data) == old.st_size, "the replacement must be as long as the file"
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (old.st_ino, old.st_size, old.st_mtime_ns)


def test_a_file_rewritten_with_its_old_size_and_mtime_is_copied_again(tmp_path, monkeypatch):
    """`cp -p` of new DiT weights over the file a stage holds a copy of: the copy that is reused (`held`, on standby)
    and the one a load reads (`ensure`) are the new file's, and the loaded weights are bitwise the new file's."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    cfg = DiTConfig.tiny(num_layers=2, adaln_form="curve")
    old, new = (write_tiny_checkpoint(cfg, tmp_path / f"{n}.safetensors", "int8_convrot_pruned", seed=s)
                for n, s in (("old", 0), ("new", 1)))
    path = tmp_path / "dit.safetensors"
    path.write_bytes(old.read_bytes())
    want_old, want_new = (load_dit_weights(f, cfg, dtype=torch.float32) for f in (old, new))
    copies = HostCopies("test")
    try:
        def load():
            return load_dit_weights(path, cfg, dtype=torch.float32, workers=2, source=from_copies(copies, [path]))

        assert_same_weights(want_old, load())
        rewrite_keeping_size_and_mtime(path, new)
        assert copies.held([path]) == {}, "a standby worker is not handed the old copy"
        assert_same_weights(want_new, load())
        gc.collect()
        assert len(memfds(os.getpid())) == 1, "the old copy went"
    finally:
        copies.release()


def test_a_video_vae_renamed_over_with_its_old_size_and_mtime_is_copied_again(tmp_path, monkeypatch):
    """The decoder's video VAE replaced the way `rsync -a` / `tar x` do it (a new file renamed over the path, the old
    mtime set on it): a load from the host copy decodes with the new weights."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    old, new, path = (tmp_path / f"{n}.safetensors" for n in ("old", "new", "vae"))
    write_tiny_video_vae(str(old), seed=0)
    write_tiny_video_vae(str(new), seed=1)
    path.write_bytes(old.read_bytes())
    want = {f: load_video_vae(str(f), dtype=torch.float16, parts="decoder").state_dict() for f in (old, new)}
    copies = HostCopies("test")
    try:
        got = load_video_vae(str(path), dtype=torch.float16, parts="decoder",
                             source=from_copies(copies, [path])).state_dict()
        assert all(torch.equal(got[k], v) for k, v in want[old].items())
        st = path.stat()
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(new, path)
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        got = load_video_vae(str(path), dtype=torch.float16, parts="decoder",
                             source=from_copies(copies, [path])).state_dict()
        assert not all(torch.equal(got[k], v) for k, v in want[old].items())
        assert all(torch.equal(got[k], v) for k, v in want[new].items())
    finally:
        copies.release()


def test_a_deleted_file_drops_its_copy_and_the_load_names_it(int8_file, tmp_path, monkeypatch):
    """A file deleted under a stage that holds its copy: the copy (and what was derived from it) goes, and the load
    that follows fails naming the file, as it would without a copy."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    path = tmp_path / "dit.safetensors"
    path.write_bytes(int8_file.read_bytes())
    key = checkpoints.derived_key(path, "int8 linears from float16")
    copies = HostCopies("test")
    try:
        assert list(copies.ensure([path], {key: 1000})) == [str(path.resolve())]
        assert list(copies.to_fill([key])) == [key] and len(memfds(os.getpid())) == 2
        path.unlink()
        assert copies.held([path]) == {}
        mapping = copies.ensure([path], {key: 1000})
        assert mapping == {} and copies.to_fill([key]) == {} and memfds(os.getpid()) == []
        with pytest.raises(checkpoints.CheckpointError, match="dit.safetensors"):
            load_dit_weights(path, DiTConfig.tiny(num_layers=2, adaln_form="curve"), dtype=torch.float32,
                             source=WeightSource.host_copies([path], mapping, {}))
    finally:
        copies.release()


def test_a_file_changed_while_it_is_copied_is_not_kept(tmp_path, monkeypatch):
    """Bytes read while the file was being rewritten are never served: the copy is refused (this turn reads the file)
    and the next load copies the file as it is then."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, ROOMY)
    cfg = DiTConfig.tiny(num_layers=2, adaln_form="curve")
    old, new = (write_tiny_checkpoint(cfg, tmp_path / f"{n}.safetensors", "int8_convrot_pruned", seed=s)
                for n, s in (("old", 0), ("new", 1)))
    path = tmp_path / "dit.safetensors"
    path.write_bytes(old.read_bytes())
    sendfile = os.sendfile

    def rewritten_meanwhile(out_fd, in_fd, offset, count):
        n = sendfile(out_fd, in_fd, offset, min(count, 4096))
        if offset == 0:
            rewrite_keeping_size_and_mtime(path, new)
        return n

    copies = HostCopies("test")
    try:
        monkeypatch.setattr(host_copy.os, "sendfile", rewritten_meanwhile)
        assert copies.ensure([path]) == {} and not copies.choice.kept and memfds(os.getpid()) == []
        monkeypatch.setattr(host_copy.os, "sendfile", sendfile)
        assert_same_weights(load_dit_weights(new, cfg, dtype=torch.float32),
                            load_dit_weights(path, cfg, dtype=torch.float32, workers=2,
                                             source=from_copies(copies, [path])))
    finally:
        copies.release()


def test_a_stage_loads_new_weights_written_over_its_file_and_status_says_when_its_files_changed(tmp_path, capsys):
    """Through a real DiT stage keeping its file in host memory: new weights written over the file with its old size
    and mtime are what the next turn computes with (and the old ones again, written back); Status names a file
    replaced or deleted since the last load, and a load after the deletion fails naming the file."""
    cfg = embedded_config()
    old, new = (write_tiny_checkpoint(cfg, tmp_path / f"{n}.safetensors", "bf16", seed=s)
                for n, s in (("old", 0), ("new", 1)))
    path = tmp_path / "models" / "dit.safetensors"
    path.parent.mkdir()
    path.write_bytes(old.read_bytes())
    s = start("dit", 1, tmp_path / "run", tmp_path / "cache", {**SERVER_ENV, WORKER_ENV: "1", MEM_AVAILABLE_ENV: ROOMY},
              ["--weights", str(path)])

    def status():
        return c.stub("dit").Status(common_pb2.StatusRequest(), timeout=10)

    def next_turn():
        c.stub("dit").Unload(common_pb2.UnloadRequest(), timeout=60)
        return sample(c, SPEC, TEXT, timeout_s=120)[0]

    try:
        with clients(s, "dit") as c:
            first = sample(c, SPEC, TEXT, timeout_s=120)[0]
            assert _status_row(c, "dit")[0].startswith("kept in host memory") and not status().changed_weight_files
            rewrite_keeping_size_and_mtime(path, new)
            st = status()
            assert dict(st.changed_weight_files) == {str(path): "replaced"}
            print_status([("dit", "here", "SERVING", st)])
            assert f"changed on disk since the last load (the next load reads them as they are): {path} (replaced)" \
                in capsys.readouterr().out
            renewed = next_turn()
            assert not status().changed_weight_files
            assert not torch.equal(renewed, first), "the turn after the replacement computes with the new weights"
            rewrite_keeping_size_and_mtime(path, old)
            assert torch.equal(next_turn(), first), "and with the old ones again once they are written back"
            path.unlink()
            assert dict(status().changed_weight_files) == {str(path): "deleted"}
            with pytest.raises(grpc.RpcError) as e:
                next_turn()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and str(path) in e.value.details()
            assert dict(status().changed_weight_files) == {str(path): "deleted"}
    finally:
        s.stop()
