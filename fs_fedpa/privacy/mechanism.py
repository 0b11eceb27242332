"""The Gaussian mechanisms of differential privacy, in plain torch (docs/privacy.md).

Client level (a trusted server): K of N clients are sampled without replacement (``fedpa.dp.sampling wor``; with
``poisson`` each client is in at rate K/N and K below is the expected count); each contribution x_i is clipped
to ``||x_i|| <= C`` (c_i = min(1, C / ||x_i||)); the release is ``(1/K) sum_i c_i x_i + N(0, (z C / K)^2 I)``, with
the fixed K in the denominator whatever arrived. Replacing one client moves the mean by at most ``2C/K``, so the
accountant sees the noise multiplier z/2 (under Poisson sampling, adding or removing one: ``C/K`` and z;
:mod:`fs_fedpa.privacy.accountant`).

Sample level (DP-SGD on a client): b of its n_i records are drawn without replacement at every step (or each record
at rate b/n_i, and b is the expected count); the per-example gradients g_j are clipped to C (:func:`add_clipped`)
and the step uses ``(sum_j c_j g_j + N(0, (z C)^2 I)) / b``; with clipping groups (a client's local head apart from
its LoRA factors) each group's part is clipped to its own C_g and noised at z_g C_g (:func:`add_clipped_groups`,
:func:`gaussian_groups`).

Every draw comes from the ``generator`` handed in (the DP generator, :func:`dp_generator`), on the host: noise is
then moved to the tensor's device, so a run's randomness does not depend on where it computes. Without a seed that
is a :class:`SecureGenerator` (the OS's cryptographic generator); torch's MT19937 is used only for seeded,
reproducible experiments or where ``fedpa.dp.secure_rng`` turns the secure one off.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from collections.abc import Sequence

import torch
from torch import Generator, Tensor

from fs_fedpa.core.norms import PART, change_sq_norm, product_sq_norm


class SecureGenerator:
    """Noise and sampling from the OS's cryptographic generator (``os.urandom``), for DP without a seed: torch's
    MT19937, seeded once, has a state that can be recovered from its outputs and stepped backwards, which would let
    an observer of some draws subtract the others.

    A Gaussian is drawn as (N_1 + N_2) / sqrt(2), each N_i by Box-Muller from two uniforms of 53 random bits in
    (0, 1), as Opacus's ``secure_mode`` sums two Gaussians (after Holohan and Braghin, 2021): the sum smooths the
    gaps of floating-point sampling that attacks on a single draw exploit. There is no state to save or restore."""

    def normal(self, shape: Sequence[int]) -> Tensor:
        """float64 N(0, 1) entries of ``shape``, on the host."""
        n = math.prod(shape)
        return ((self._box_muller(n) + self._box_muller(n)) / math.sqrt(2.0)).reshape(tuple(shape))

    def _box_muller(self, n: int) -> Tensor:
        m = (n + 1) // 2
        u = self._uniform(2 * m)
        u1, u2 = u[:m], u[m:]
        radius = torch.sqrt(-2.0 * torch.log(u1))
        pairs = torch.cat([radius * torch.cos(2 * math.pi * u2), radius * torch.sin(2 * math.pi * u2)])
        return pairs[:n]

    @staticmethod
    def _uniform(n: int) -> Tensor:
        """n uniforms in (0, 1): (k + 0.5) / 2^53 for k of 53 random bits."""
        if n == 0:
            return torch.zeros(0, dtype=torch.float64)
        raw = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
        k = (raw & ((1 << 53) - 1)).double()
        return (k + 0.5) / float(1 << 53)

    def sample(self, population: int, size: int) -> list[int]:
        """``size`` of ``range(population)`` uniformly without replacement, sorted."""
        return sorted(secrets.SystemRandom().sample(range(population), size))


def dp_generator(seed: int = -1, stream: str = "", secure: bool = True) -> Generator | SecureGenerator:
    """A host generator for noise and sampling: without a seed (``seed`` -1), the OS's cryptographic generator
    (:class:`SecureGenerator`), or with ``secure`` False torch's MT19937 seeded from OS entropy; with a seed, for
    reproducible experiments, MT19937 seeded from blake2b(``seed``, ``stream``), so the server and each client draw
    independent streams."""
    if seed < 0:
        return SecureGenerator() if secure else torch.Generator().manual_seed(secrets.randbits(63))
    key = hashlib.blake2b(f"fedpa-dp:{seed}:{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def sample_without_replacement(population: int, size: int, generator: Generator) -> list[int]:
    """``size`` of ``range(population)`` uniformly without replacement, sorted (all when size >= population)."""
    if size >= population:
        return list(range(population))
    if isinstance(generator, SecureGenerator):
        return generator.sample(population, size)
    return sorted(torch.randperm(population, generator=generator)[:size].tolist())


def sample_poisson(population: int, rate: float, generator: Generator | SecureGenerator) -> list[int]:
    """Poisson sampling: each of ``range(population)`` in independently with probability ``rate``, sorted (the
    sample size is random, possibly 0)."""
    if rate >= 1:
        return list(range(population))
    if isinstance(generator, SecureGenerator):
        u = generator._uniform(population)
    else:
        u = torch.rand(population, generator=generator, dtype=torch.float64)
    return torch.nonzero(u < rate).flatten().tolist()


def clip_scale(sq_norm: float, C: float) -> float:
    """c = min(1, C / ||x||) for a contribution of squared norm ``sq_norm``: ``||c x|| <= C``; 0 where the norm is
    not finite (inf or NaN), and then the caller must drop the contribution itself, since 0 * inf is NaN."""
    norm = float(sq_norm) ** 0.5
    if not math.isfinite(norm):
        return 0.0
    return 1.0 if norm <= C else C / norm


def gaussian(shape: Sequence[int], std: float, generator: Generator, like: Tensor) -> Tensor:
    """N(0, std^2) entries of ``shape``, drawn on the host in float64 from ``generator``, as ``like``'s dtype and
    device."""
    if isinstance(generator, SecureGenerator):
        noise = generator.normal(shape) * std
    else:
        noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * std
    return noise.to(device=like.device, dtype=like.dtype)


def gaussian_flat(sizes: Sequence[int], std: float, generator: Generator | SecureGenerator, like: Tensor) -> Tensor:
    """:func:`gaussian` for tensors of ``sizes`` entries, one after the other, as one flat tensor of ``like``'s dtype
    and device: with torch's generator the very numbers that ``gaussian`` would draw for each in turn (one draw a
    tensor into a host buffer: the stream, and so a seeded or resumed run, is unchanged); the secure generator, which
    has no stream to follow, draws them at once. One copy to the device instead of one a tensor."""
    if isinstance(generator, SecureGenerator):
        noise = generator.normal((sum(sizes),))
    else:
        noise = torch.empty(sum(sizes), dtype=torch.float64)
        offset = 0
        for n in sizes:
            noise[offset : offset + n].normal_(generator=generator)  # = torch.randn(n, generator=generator)
            offset += n
    return noise.mul_(std).to(device=like.device, dtype=like.dtype)


def gaussian_groups(sizes: Sequence[int], stds: Sequence[float], generator: Generator | SecureGenerator,
                    like: Tensor) -> Tensor:  # fmt: skip
    """:func:`gaussian_flat` with a standard deviation a tensor: entry block i (``sizes[i]`` entries) is
    N(0, stds[i]^2), from the same numbers ``gaussian_flat`` draws at std 1."""
    noise = gaussian_flat(sizes, 1.0, generator, like)
    scale = torch.repeat_interleave(torch.tensor(list(stds), dtype=torch.float64), torch.tensor(list(sizes)))
    return noise.mul_(scale.to(device=noise.device, dtype=noise.dtype))


def noisy_mean(tensors: Sequence[Tensor], scales: Sequence[float], K: int, std: float, generator: Generator,
               like: Tensor) -> Tensor:  # fmt: skip
    """``(1/K) sum_i c_i t_i + N(0, std^2)``, entrywise, for tensors of one shape (none: the noise alone, in
    ``like``'s shape)."""
    total = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    for t, c in zip(tensors, scales):
        if c:  # c = 0: a non-finite contribution, dropped (0 * inf is NaN)
            total += c * t.double()
    return (total / K + gaussian(like.shape, std, generator, total)).to(like.dtype)


def noisy_mean_product(Bs: Sequence[Tensor], As: Sequence[Tensor], scales: Sequence[float], K: int, std: float,
                       generator: Generator, shape: tuple[int, int], like: Tensor) -> Tensor:  # fmt: skip
    """The (d, k) release of one module, ``(1/K) sum_i c_i B_i A_i + N(0, std^2)``: one (d, sum r_i) x (sum r_i, k)
    product in float64, then the noise; the only d x k matrices are this one and its noise."""
    kept = [(B, A, c) for B, A, c in zip(Bs, As, scales) if c]  # c = 0: a non-finite contribution, dropped
    if kept:
        B = torch.cat([c * B.double() for B, _, c in kept], 1)
        total = B @ torch.cat([A.double() for _, A, _ in kept], 0)
    else:
        total = torch.zeros(shape, dtype=torch.float64, device=like.device)
    return (total / K + gaussian(shape, std, generator, total)).to(like.dtype)


def add_clipped(total: list[Tensor] | None, grads: Sequence[Tensor], C: float) -> tuple[list[Tensor], float]:
    """``total + c g`` (float64, on g's device) for one example's gradient ``g`` (a list of tensors, one per
    trainable parameter), clipped jointly to ``||c g|| <= C``; also c. ``total`` None starts the sum. A gradient
    whose norm is not finite contributes exactly zero (c = 0): it cannot turn the sum into NaN."""
    c = clip_scale(sum(float(g.double().pow(2).sum()) for g in grads), C)
    if c == 0.0:
        grads = [torch.zeros_like(g, dtype=torch.float64) for g in grads]
    if total is None:
        return [c * g.double() for g in grads], c
    for t, g in zip(total, grads):
        t.add_(g.double(), alpha=c)
    return total, c


def add_clipped_groups(total: list[Tensor] | None, grads: Sequence[Tensor], groups: Sequence[int],
                       clips: Sequence[float]) -> tuple[list[Tensor], float]:  # fmt: skip
    """:func:`add_clipped` with the tensors in clipping groups: tensor i is in group ``groups[i]``, and each group's
    part of the example's gradient is clipped to its own ``clips[g]`` (``||c_g g_g|| <= C_g``); also the smallest
    c_g. A gradient whose norm is not finite in any group contributes exactly zero in all (c = 0)."""
    sq = [0.0] * len(clips)
    for g, k in zip(grads, groups):
        sq[k] += float(g.double().pow(2).sum())
    c = [clip_scale(v, C) for v, C in zip(sq, clips)]
    if min(c) == 0.0:
        c = [0.0] * len(clips)
        grads = [torch.zeros_like(g, dtype=torch.float64) for g in grads]
    if total is None:
        return [c[k] * g.double() for g, k in zip(grads, groups)], min(c)
    for t, g, k in zip(total, grads, groups):
        t.add_(g.double(), alpha=c[k])
    return total, min(c)


def release_products(uploads: Sequence[dict[str, tuple[Tensor, Tensor]]], shapes: dict[str, tuple[int, int]], K: int,
                     C: float, z: float, generator: Generator, extra_sq: Sequence[float] | None = None,
                     ) -> tuple[dict[str, Tensor], list[float]]:  # fmt: skip
    """Client-level release of product-space methods: per module the (d, k) noisy mean
    ``(1/K) sum_i c_i B_i A_i + N(0, (z C / K)^2)``, each client's whole update ``{B_i A_i}`` over modules clipped to
    Frobenius norm C (norms from the factors in float64, :func:`~fs_fedpa.core.norms.product_sq_norm`); also
    the c_i. ``uploads``: applied factors, at most K of them (a missing client contributes zero); ``shapes[name] =
    (d, k)``. ``extra_sq[i]``: the squared norm of the rest of client i's contribution (its federated non-LoRA
    tensors' change, :func:`release_shared`), clipped with it."""
    extra = extra_sq if extra_sq is not None else [0.0] * len(uploads)
    scales = [clip_scale(product_sq_norm({n: (B.double(), A.double()) for n, (B, A) in u.items()}) + e, C)
              for u, e in zip(uploads, extra)]  # fmt: skip
    std = z * C / K
    like = next(iter(uploads[0].values()))[0] if uploads else torch.zeros(())
    release = {}
    for name, (d, k) in shapes.items():  # one module at a time: one d x k matrix (and its noise) alive at once
        release[name] = noisy_mean_product([u[name][0] for u in uploads], [u[name][1] for u in uploads], scales, K,
                                           std, generator, (d, k), like)  # fmt: skip
    return release, scales


def release_changes(uploads: Sequence[dict[str, tuple[Tensor, Tensor]]], starts: Sequence[dict[str, tuple[Tensor,
                    Tensor]]], parts: Sequence[str], K: int, C: float, z: float, generator: Generator,
                    extra_sq: Sequence[float] | None = None,
                    ) -> tuple[dict[str, dict[str, Tensor]], list[float]]:  # fmt: skip
    """Client-level release of factor-averaging methods: per module and uploaded part (``"B"``, ``"A"``) the noisy
    mean change ``(1/K) sum_i c_i (X_i - X_i^0) + N(0, (z C / K)^2)``, where ``X_i^0`` is what client i started from
    (``starts[i]``, the factors it received) and each client's change over all modules and parts is clipped to
    Frobenius norm C; also the c_i. ``starts`` must hold one entry per upload, or one for all (``len == 1``) when there
    are none. ``extra_sq[i]``: the squared norm of the rest of client i's contribution (its federated non-LoRA
    tensors' change, :func:`release_shared`), clipped with it."""
    changes = [{(n, p): u[n][PART[p]].double() - s[n][PART[p]].double() for n in u for p in parts}
               for u, s in zip(uploads, starts)]  # fmt: skip
    extra = extra_sq if extra_sq is not None else [0.0] * len(uploads)
    scales = [clip_scale(change_sq_norm(u, s, parts) + e, C) for u, s, e in zip(uploads, starts, extra)]
    std = z * C / K
    release: dict[str, dict[str, Tensor]] = {}
    for name, pair in starts[0].items():
        release[name] = {}
        for p in parts:
            like = pair[PART[p]]
            release[name][p] = noisy_mean([c[(name, p)] for c in changes], scales, K, std, generator, like)
    return release, scales


def shared_changes(uploads: Sequence[dict[str, Tensor]], start: dict[str, Tensor]) -> tuple[list[dict[str, Tensor]],
                                                                                             list[float]]:  # fmt: skip
    """Each client's change ``X_i - X^0`` of the federated non-LoRA tensors (e.g. a shared head; float64) from the
    values ``start`` the round sent, and its squared Frobenius norm over all of them: the part of its contribution
    that client-level DP clips together with its LoRA update (``extra_sq`` of :func:`release_products` and
    :func:`release_changes`). ValueError where a tensor's shape differs from its start's."""
    changes, sq = [], []
    for u in uploads:
        change = {}
        for name, x0 in start.items():
            if u[name].shape != x0.shape:
                raise ValueError(f"{name}: shape {tuple(u[name].shape)}, started from {tuple(x0.shape)}")
            change[name] = u[name].double() - x0.double()
        changes.append(change)
        sq.append(sum(float(c.pow(2).sum()) for c in change.values()))
    return changes, sq


def release_shared(changes: Sequence[dict[str, Tensor]], scales: Sequence[float], K: int, C: float, z: float,
                   generator: Generator, start: dict[str, Tensor]) -> dict[str, Tensor]:  # fmt: skip
    """The new federated non-LoRA tensors under client-level DP: ``X^0 + (1/K) sum_i c_i (X_i - X^0) + N(0, (z C /
    K)^2)`` per tensor, with the c_i that clipped each client's whole contribution (LoRA update and these changes
    together), so the release's sensitivity stays C / K."""
    std = z * C / K
    return {name: (x0.double() + noisy_mean([c[name] for c in changes], scales, K, std, generator, x0.double())
                   ).to(x0.dtype) for name, x0 in start.items()}  # fmt: skip
