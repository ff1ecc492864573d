"""PRX's joint attention as one FlashAttention-4 call on Hopper (``attention_kernel: flash4``).

The same key-padding layout as ``cudnn_attention`` ([image keys; the kept text keys, in order;
zeros], written by the norm/RoPE kernels), run by FlashAttention-4's Hopper forward kernel
(``flash-attn-4``, the ``flash4`` extra: CuTe DSL; its import took 9.1 s and its kernel's compile at
the first call 1.3 s on the H200, both once per process, in the warm-up thread while the first engine
set builds) with ``seqused_k`` = image + kept keys per batch row: exact, one kernel. At PRX's head
dim of 64 it ran 498-540 TFLOP/s on the H200 against cuDNN's 396-407
(``benchmarks/results/step_levers_flash4_h200.json``).

Measured on Hopper only, so ``supported`` asks for compute capability 9.x; elsewhere (and where the
package does not import) ``prx_attention_flash4`` runs the cuDNN call or the split path instead.

FlashAttention-4 compiles its kernel once per process. Its own disk cache, which a user turns on with
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` (and ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``), keeps the
compiled kernels as native objects that it loads: FLUX.1's first step in a new process took 2.6-3.0 s
with it filled, 5.2-6.6 s without (``benchmarks/results/flux_v26_load_h200.json``). ``kernel`` uses
FlashAttention-4 with that cache only where the cache directory, everything in it and the folders
above are this user's alone or root's (``untrusted_cache``): its default, under the shared temporary
directory, could otherwise be planted by another user.
"""

from __future__ import annotations

import getpass
import grp
import importlib.util
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_UNSET = object()
_KERNEL = _UNSET


def installed() -> bool:
    """Whether FlashAttention-4's package is installed (it is not imported here)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # a ``flash_attn`` without ``cute`` (FlashAttention-2)
        return False


def kernel():
    """``flash_attn.cute.flash_attn_varlen_func``, or None (not installed, no CUDA, its kernel cache
    turned on in a directory ``untrusted_cache`` refuses, import failed). Imported once per process;
    why it is not used is logged once."""
    global _KERNEL
    if _KERNEL is not _UNSET:
        return _KERNEL
    _KERNEL = None
    if not (torch.cuda.is_available() and installed()):
        return None
    why = untrusted_cache()
    if why is not None:
        logger.warning("flash4 attention: not used: FlashAttention-4's kernel cache %s", why)
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # a broken install must not break the compiled module
        logger.warning("flash4 attention: FlashAttention-4 did not load (%s); using another kernel", e)
        return None
    _KERNEL = flash_attn_varlen_func
    return _KERNEL


#: FlashAttention-4's switches for its disk cache of compiled kernels (read when it is imported)
CACHE_ENABLED, CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def untrusted_cache() -> str | None:
    """Why FlashAttention-4's disk cache, where the environment turns it on, must not be used; None
    where it is off or trusted.

    Its directory is found as FlashAttention-4 finds it: ``$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` if
    set (an empty value is the current directory), else ``<tmp>/<user>/flash_attention_cute_dsl_cache``.
    The directory and everything in it must be this user's, no link, and writable by no one else (a
    group that is this user's own private group aside: umask 002 makes files so). Each folder above
    it, up to the first of root's that only root may change, must be this user's or root's, and a
    link among them too (another user's folder or link above it could swap the cache)."""
    if os.environ.get(CACHE_ENABLED, "0") != "1":
        return None
    where = os.environ.get(CACHE_DIR)
    default = Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"
    root = Path(os.path.abspath(where if where is not None else default))
    uid = os.geteuid()
    try:
        inside = [root, *sorted(root.rglob("*"))] if root.is_dir() and not root.is_symlink() else [root]
        for p in inside:
            try:
                st = os.lstat(p)
            except FileNotFoundError:  # not made yet, or another process's temporary file, gone
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_uid != uid or _writable_by_others(st):
                return (
                    f"{p} is not yours alone (a link, another owner or writable by others): set {CACHE_DIR}."
                )
        for chain in (root.parents, Path(os.path.realpath(root)).parents):  # as written, as resolved
            why = _folders_above(chain, uid)
            if why is not None:
                return why
    except OSError as e:
        return f"{root} cannot be examined ({e.strerror})."
    return None


def _folders_above(chain, uid: int) -> str | None:
    """Why a folder or link of ``chain`` (a path's parents, nearest first) could be swapped by
    another user; None up to the first folder of root's that only root may change."""
    for p in chain:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (uid, 0):
                return f"{p}, a link above it, is another user's: set {CACHE_DIR}."
            st = os.stat(p)  # where a link of ours or root's points
        sticky_tmp = st.st_uid == 0 and st.st_mode & stat.S_ISVTX  # /tmp: no one swaps ours
        if st.st_uid not in (uid, 0) or (_writable_by_others(st) and not sticky_tmp):
            return f"{p}, a folder above it, is not yours or root's alone: set {CACHE_DIR}."
        if st.st_uid == 0:
            return None
    return None


def _writable_by_others(st: os.stat_result) -> bool:
    """Whether a user other than this one may write where ``st`` describes: others' write bit, or
    the group's unless the group is this user's private group (its primary one, named after it,
    with no other members)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return True
    if not mode & stat.S_IWGRP:
        return False
    try:
        group, user = grp.getgrgid(st.st_gid), pwd.getpwuid(os.geteuid())
    except KeyError:  # a group or user without a name: not a private group
        return True
    return not (st.st_gid == user.pw_gid and group.gr_name == user.pw_name and not group.gr_mem)


def supported(q: torch.Tensor) -> bool:
    """Whether ``padded_attention`` takes ``q`` (B, L, H, D): a Hopper GPU (what was measured),
    fp16/bf16, D a multiple of 8 up to 256, and the package loaded."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and kernel() is not None
    )


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of each row's queries over its first ``seq[1, b]`` keys, in one kernel.

    Args:
        q: (B, Lq, H, D) contiguous. k, v: (B, S, H, D) contiguous, S >= every ``seq[1, :B]``.
        seq: (2, >= B) int32, ``seq[1, :B]`` = the keys each row attends (``seq[0]`` is not read).
        scale: the softmax scale.

    Returns:
        (B, Lq, H, D) contiguous.
    """
    b = q.shape[0]
    out = kernel()(q, k, v, seqused_k=seq[1, :b], softmax_scale=scale)
    return out[0] if isinstance(out, tuple) else out
