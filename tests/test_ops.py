"""The attention ops' CPU fallbacks and the log-sum-exp merge they use on the GPU."""

import torch

from prx_compile.ops import kernels
from prx_compile.ops.library import _reference, flash_attention, joint_attention


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def partial(q, k, v, mask, scale):
    """Exact attention over a subset of keys with its log-sum-exp: (out (B,Lq,H,D), lse (B,H,Lq))."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()), lse


def test_lse_merge_is_exact_including_empty_parts():
    q, ka, kb = rand(2, 5, 3, 8), rand(2, 4, 3, 8, seed=1), rand(2, 6, 3, 8, seed=2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1] = False  # row 1: the masked part has no keys at all
    ref = _reference(
        q.double(),
        torch.cat([ka, kb], 1).double(),
        torch.cat([ka, kb], 1).double(),
        torch.cat([mask, torch.ones(2, 6, dtype=torch.bool)], 1),
        0.3,
    )
    o1, l1 = partial(q, kb, kb, None, 0.3)
    o2, l2 = partial(q, ka, ka, mask, 0.3)
    merged = kernels.merge_torch(o1, l1, o2, l2)
    torch.testing.assert_close(merged, ref, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(merged).all()


def test_joint_attention_cpu_fallback_equals_sdpa():
    q, ka, va, kb, vb = (rand(2, 5, 3, 8, seed=i) for i in range(5))
    mask = torch.tensor([[True] * 5, [True, False, True, False, False]])
    out = joint_attention(q, ka, va, mask, kb, vb, 0.35)
    ref = _reference(
        q,
        torch.cat([ka, kb], 1),
        torch.cat([va, vb], 1),
        torch.cat([mask, torch.ones(2, 5, dtype=torch.bool)], 1),
        0.35,
    )
    assert torch.equal(out, ref)


def test_flash_attention_cpu_fallback_and_empty_rows():
    q, k, v = rand(2, 5, 3, 8), rand(2, 7, 3, 8, seed=1), rand(2, 7, 3, 8, seed=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    out = flash_attention(q, k, v, mask, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    additive = torch.zeros(2, 7).masked_fill(~mask, float("-inf"))
    assert torch.equal(flash_attention(q, k, v, additive, 0.3)[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(flash_attention(q, k, v, additive, 0.3)[0], out[0])


def test_ops_are_exportable_and_keep_their_names():
    class M(torch.nn.Module):
        def forward(self, q, k, v, m):
            return torch.ops.prx_compile.flash_attention(q, k, v, m, 0.5)

    args = (rand(1, 4, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8), torch.ones(1, 6, dtype=torch.bool))
    ep = torch.export.export(M(), args)
    assert any(n.target == torch.ops.prx_compile.flash_attention.default for n in ep.graph.nodes)


def test_flashattention4s_kernel_cache_is_used_only_where_it_is_private(tmp_path, monkeypatch):
    """FlashAttention-4's disk cache holds native objects it loads: with the cache turned on, its
    directory and what is in it must be this user's alone, the folders (and links) above this
    user's or root's. Found as FlashAttention-4 finds it: the default under the temporary
    directory, and an empty variable meaning the current directory."""
    import grp
    import os
    import pwd
    import tempfile

    import pytest

    from prx_compile.ops import flash4_attention as fa

    monkeypatch.delenv(fa.CACHE_ENABLED, raising=False)
    assert fa.untrusted_cache() is None  # off: nothing to check
    monkeypatch.setenv(fa.CACHE_ENABLED, "1")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    cache = home / "fa4"
    monkeypatch.setenv(fa.CACHE_DIR, str(cache))
    assert fa.untrusted_cache() is None  # not made yet: FlashAttention-4 makes it, as this user
    (cache / "fp" / "fwd").mkdir(parents=True, mode=0o755)
    obj = cache / "fp" / "fwd" / "k.o"
    obj.write_bytes(b"\x7fELF")
    os.chmod(obj, 0o644)
    assert fa.untrusted_cache() is None
    os.chmod(obj, 0o646)  # a kernel anyone could rewrite
    assert "k.o is not yours alone" in fa.untrusted_cache()
    os.chmod(obj, 0o644)
    link = home / "link"
    link.symlink_to(cache)
    monkeypatch.setenv(fa.CACHE_DIR, str(link))
    assert "link is not yours alone" in fa.untrusted_cache()
    monkeypatch.setenv(fa.CACHE_DIR, str(cache))
    os.chmod(home, 0o777)  # a folder above that others may change: they could swap the cache
    assert "a folder above it" in fa.untrusted_cache()
    os.chmod(home, 0o755)
    monkeypatch.setenv(fa.CACHE_DIR, "")  # FlashAttention-4 reads that as the current directory
    monkeypatch.chdir(cache / "fp")
    assert fa.untrusted_cache() is None
    os.chmod(obj, 0o646)
    assert "k.o is not yours alone" in fa.untrusted_cache()
    os.chmod(obj, 0o644)
    monkeypatch.delenv(fa.CACHE_DIR)  # the default: <tmp>/<user>/flash_attention_cute_dsl_cache
    monkeypatch.setattr(tempfile, "tempdir", str(home))
    default = home / __import__("getpass").getuser() / "flash_attention_cute_dsl_cache"
    default.mkdir(parents=True, mode=0o755)
    (default / "k.o").write_bytes(b"")
    os.chmod(default / "k.o", 0o646)
    assert f"{default / 'k.o'} is not yours alone" in fa.untrusted_cache()
    monkeypatch.setenv(fa.CACHE_DIR, str(cache))
    user = pwd.getpwuid(os.geteuid())
    own = grp.getgrgid(os.getegid())
    if own.gr_name == user.pw_name and not own.gr_mem:  # umask 002 with a private group: fine
        os.chmod(cache / "fp", 0o775)
        assert fa.untrusted_cache() is None
        os.chmod(cache / "fp", 0o755)
    if os.geteuid() != 0:
        pytest.skip("other owners and groups need root to make")
    os.chown(cache / "fp", -1, 12345)  # a group of others may write: refused
    os.chmod(cache / "fp", 0o775)
    assert "fp is not yours alone" in fa.untrusted_cache()
    os.chmod(cache / "fp", 0o755)
    os.chown(obj, 12345, -1)
    assert "k.o is not yours alone" in fa.untrusted_cache()
    os.chown(obj, 0, -1)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    (elsewhere / "up").symlink_to(home)  # another user's link above the cache
    os.lchown(elsewhere / "up", 12345, -1)
    monkeypatch.setenv(fa.CACHE_DIR, str(elsewhere / "up" / "fa4"))
    assert "a link above it, is another user's" in fa.untrusted_cache()
    monkeypatch.setenv(fa.CACHE_DIR, str(cache))
    os.chown(home, 12345, -1)
    assert "a folder above it" in fa.untrusted_cache()
