"""The engine cache trusts only its owner (issue 26): entries of another uid, writable by others, or
symbolic links are refused with an ArtifactError naming the path; PRX_COMPILE_CACHE_SHARED=1 is the
documented way to share a cache between users."""

import json
import os
import shutil
import stat

import pytest

from prx_compile import ArtifactError, compile_prx
from prx_compile.io.artifact import MANIFEST
from prx_compile.io.cache import SHARED_ENV
from prx_compile.tools.testing import make_prx

from .conftest import prx_inputs

RANGE = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1, static=True)
OTHER_UID = 12345


def run(cache):
    """Compile a tiny PRX with the engine cache ``cache`` and run it once: (compiled, hit?)."""
    cfg = dict(RANGE, specialize=[[16, 16, 2]], engine_cache_dir=str(cache), backend="eager")
    model = make_prx()
    ct = compile_prx(model, **cfg)
    ct(**prx_inputs(model, h=16, w=16, text=16), return_dict=False)
    return ct, ct.cache_hits[0]["load_s"] is not None


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache holding one entry, built once: (cache, entry name)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SHARED_ENV, raising=False)
        root = tmp_path_factory.mktemp("built") / "cache"
        ct, hit = run(root)
    assert not hit
    return root, ct.cache_hits[0]["key"]


@pytest.fixture
def cache(built_cache, tmp_path, monkeypatch):
    """A copy of that cache (modes kept: copytree copies them) for a test to change, and its entry."""
    monkeypatch.delenv(SHARED_ENV, raising=False)
    root, key = built_cache
    copy = shutil.copytree(root, tmp_path / "cache", symlinks=True)
    assert stat.S_IMODE(os.stat(copy).st_mode) == stat.S_IMODE(os.stat(root).st_mode) == 0o700
    return copy, copy / key


def give_away(path, monkeypatch, fake=False):
    """Make ``path`` another user's: a real chown as root (as in CI), else (or with ``fake``)
    os.stat/os.lstat report it so."""
    if os.geteuid() == 0 and not fake:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
        return
    real_stat, real_lstat, target = os.stat, os.lstat, os.path.abspath(path)

    def fake(real):
        def f(p, *a, **kw):
            st = real(p, *a, **kw)
            if isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == target:
                fields = list(st)
                fields[stat.ST_UID] = OTHER_UID
                return os.stat_result(fields)
            return st

        return f

    monkeypatch.setattr(os, "stat", fake(real_stat))
    monkeypatch.setattr(os, "lstat", fake(real_lstat))


def test_a_fresh_cache_is_private_and_hits_even_with_a_group_umask(tmp_path, monkeypatch):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    old = os.umask(0o002)
    try:
        assert run(tmp_path / "c")[1] is False
        assert run(tmp_path / "c")[1] is True
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700


@pytest.mark.parametrize("fake", [False, True])
def test_an_entry_of_another_user_is_refused_naming_it(cache, monkeypatch, fake):
    root, entry = cache
    give_away(entry, monkeypatch, fake)
    with pytest.raises(ArtifactError, match=rf"{entry} belongs to uid {OTHER_UID}, not to you.*chown") as e:
        run(root)
    assert "\n" not in str(e.value) and SHARED_ENV in str(e.value)


def test_a_file_of_another_user_inside_an_entry_is_refused_not_rebuilt(cache, monkeypatch):
    from prx_compile.io.artifact import _chunk_hashes

    root, entry = cache
    planted = entry / "engine.bin"  # a listed file (a TensorRT entry lists its engines)
    planted.write_bytes(b"\0" * 100)
    m = json.loads((entry / MANIFEST).read_text())
    with open(planted, "rb") as f:
        m["files"]["engine.bin"] = {"bytes": 100, "sha256": _chunk_hashes(f.fileno())}
    (entry / MANIFEST).write_text(json.dumps(m))
    before = sorted((p.name, p.read_bytes()) for p in entry.iterdir())
    assert run(root)[1] is True  # this user's own: loaded
    give_away(planted, monkeypatch)
    with pytest.raises(ArtifactError, match=rf"{planted} belongs to uid {OTHER_UID}"):
        run(root)
    assert sorted((p.name, p.read_bytes()) for p in entry.iterdir()) == before  # nothing replaced


def test_a_damaged_entry_of_this_users_is_built_again_and_replaced(cache, caplog):
    """0.26 refused to overwrite an entry whose manifest did not parse: every process built it again."""
    root, entry = cache
    (entry / MANIFEST).write_text("{broken")
    os.chmod(entry / MANIFEST, 0o600)
    assert run(root)[1] is False  # built again, with a warning
    assert "cannot be used" in caplog.text and "could not be written" not in caplog.text
    assert run(root)[1] is True  # and stored: the next process hits


@pytest.mark.parametrize("what", ["entry", "manifest", "root"])
def test_writable_by_others_is_refused(cache, what):
    root, entry = cache
    path = {"entry": entry, "manifest": entry / MANIFEST, "root": root}[what]
    os.chmod(path, 0o775 if what != "manifest" else 0o664)
    with pytest.raises(
        ArtifactError, match=rf"{path} is writable by group or others \(mode 7?[76]\d4?\).*chmod go-w"
    ):
        run(root)


def test_a_symlinked_entry_is_never_followed(cache, tmp_path):
    root, entry = cache
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (other / entry.name).symlink_to(entry)
    with pytest.raises(ArtifactError, match=rf"{other / entry.name} is a symbolic link"):
        run(other)


def test_a_shared_cache_is_a_setting(cache, monkeypatch):
    root, entry = cache
    give_away(entry, monkeypatch)
    os.chmod(entry, 0o770)
    monkeypatch.setenv(SHARED_ENV, "1")
    assert run(root)[1] is True  # another user's, group-writable: trusted on purpose
    os.chmod(entry, 0o777)
    with pytest.raises(ArtifactError, match=rf"{entry} is writable by every user \(mode 777\)"):
        run(root)
    os.chmod(entry, 0o700)
    link = root / "link"
    link.symlink_to(entry)
    from prx_compile.io.cache import check_trusted

    with pytest.raises(ArtifactError, match="is a symbolic link"):
        check_trusted(link)


def test_a_cache_directory_given_as_a_link_stores_and_hits(tmp_path, monkeypatch):
    """0.16 never stored an entry through a linked cache root (the folder lock refused the link) and
    built again every time; the user's own linked folder is fine, entries stay refused as links."""
    monkeypatch.delenv(SHARED_ENV, raising=False)
    real = tmp_path / "real-cache"
    real.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    link.symlink_to(real)
    ct, hit = run(link)
    assert not hit and (real / ct.cache_hits[0]["key"] / MANIFEST).is_file()
    _, hit = run(link)
    assert hit  # loaded from the entry stored through the link
    entry = real / ct.cache_hits[0]["key"]
    moved = entry.rename(tmp_path / "elsewhere")
    entry.symlink_to(moved)  # an entry that is a link is still never followed
    with pytest.raises(ArtifactError, match="symbolic link"):
        run(link)


def test_what_an_export_bakes_in_is_in_the_key(tmp_path, caplog):
    """A setting (an eps) or an attention processor's class is a constant of the engines: another
    one is another entry (0.31's key held the config only, so a model with a custom processor and a
    plain one shared an entry, and TensorRT would load the other's engines). Forward hooks are
    functions no key can name: that set builds without the cache, with a warning."""
    import logging

    cfg = dict(RANGE, specialize=[[16, 16, 2]], engine_cache_dir=str(tmp_path / "cache"), backend="eager")
    kw = prx_inputs(make_prx(), h=16, w=16, text=16)

    def key(edit):
        model = make_prx()
        edit(model)
        ct = compile_prx(model, **cfg)
        ct(**kw, return_dict=False)
        return ct.cache_hits[0]["key"]

    class Mine(type(make_prx().blocks[1].attention.processor)):
        pass

    plain = key(lambda m: None)
    assert key(lambda m: None) == plain
    assert key(lambda m: setattr(m, "lora_scale", 0.7)) == plain  # diffusers' fuse_lora leaves it: no setting
    assert key(lambda m: setattr(m.blocks[0].img_pre_norm, "eps", 0.5)) not in (plain, None)
    assert key(lambda m: m.blocks[1].attention.set_processor(Mine())) not in (plain, None)
    with caplog.at_level(logging.WARNING, logger="prx_compile.io"):
        assert key(lambda m: m.blocks[0].register_forward_hook(lambda mod, a, out: out)) is None
    assert "engine cache not used" in caplog.text and "blocks.0 hold forward hooks" in caplog.text


def test_settings_read_a_list_as_the_tuple_python_code_gives():
    """A config read from JSON gives lists where Python code gives tuples (FLUX's ``axes_dims_rope``):
    one model, one key."""
    import torch

    from prx_compile.export import settings

    a, b = torch.nn.Module(), torch.nn.Module()
    a.axes, b.axes = (16, 56, 56), [16, 56, 56]
    b.big = list(range(100))  # long lists are no setting
    assert settings(a) == settings(b) == {"axes": (16, 56, 56)}


def test_the_memory_of_a_device_this_machine_lacks_is_unknown():
    import torch

    from prx_compile.io.artifact import available_bytes

    if not torch.cuda.is_available():
        assert available_bytes(torch.device("cuda:5")) is None
    assert available_bytes(torch.device("cpu")) > 0
