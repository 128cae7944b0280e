# SPDX-License-Identifier: Apache-2.0
"""Runtime's state: the units' values as a state dict, checkpoints, statistics, the loss scale and
the optimizer's settings."""

from __future__ import annotations

import os

import torch

from .. import _core


class _State:
    """Runtime's methods on its state (Runtime inherits them; the state is Runtime's)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every unit's parameters and buffers from the home copies, keyed ``"<unit>.<name>"``
        (CPU tensors, copies). Writes dirty units back first (synchronises)."""
        core = self.core
        self._expect_between_steps("state_dict")
        self._began = True  # flush() brings the pinned units onto the device
        core.flush()
        out = {}
        for u in self.units:
            for e, t in zip(u._entries, u._shaped(core.home(u.id, "params"))):
                out[f"{u.name}.{e.name}"] = t.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Sets every unit's parameters and buffers (and f32 master copy) from ``state``, keyed as
        state_dict gives them: every key, no other, each with its tensor's shape. Before the
        first plan, step, state_dict or checkpoint save (units on the device would not see it).
        AdamW moments and step counts keep their values, and a bf16/f16 unit's master copy is the
        loaded value: a checkpoint is the exact resume. Refused, it changes nothing."""
        if self._closed:
            raise _core.InvalidArgument("taskswap: the runtime was closed; make a new one")
        if self._began:
            raise _core.InvalidArgument("taskswap: load_state_dict after the first plan, step, state_dict or "
                                        "checkpoint save cannot reach units already on the device; call it "
                                        "before, or use load_checkpoint")
        expected = {f"{u.name}.{e.name}": (u, j) for u in self.units for j, e in enumerate(u._entries)}
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise _core.InvalidArgument(f"taskswap: load_state_dict: missing keys {missing[:5]}, unexpected keys "
                                        f"{unexpected[:5]}")
        for key, (u, j) in expected.items():
            if tuple(state[key].shape) != u._entries[j].shape:
                raise _core.InvalidArgument(f"taskswap: load_state_dict: '{key}' has shape {tuple(state[key].shape)}, "
                                            f"the tensor {u._entries[j].shape}")
        with torch.no_grad():
            if self._core is None:
                for key, (u, j) in expected.items():
                    u._entries[j].tensor.copy_(state[key])
                return
            for u in self.units:
                kinds = ["params"] if u.dtype == torch.float32 or not u.trainable else ["params", "master"]
                for kind in kinds:
                    for home, e in zip(u._shaped(self._core.home(u.id, kind)), u._entries):
                        home.copy_(state[f"{u.name}.{e.name}"])

    def save_checkpoint(self, path: str | os.PathLike, user: dict[str, str] | None = None) -> None:
        """Writes every unit's home state (parameters, master, moments, steps) and the plan
        position to the directory ``path``, atomically (see docs/reliability.md)."""
        self._expect_between_steps("save_checkpoint")
        core = self.core
        self._began = True  # it writes dirty units back, bringing the pinned units onto the device
        core.save_checkpoint(os.fspath(path), user or {})

    def load_checkpoint(self, path: str | os.PathLike) -> tuple[int, dict[str, str]]:
        """Restores every unit from a checkpoint before the first plan or step; returns
        (steps done, the trainer's own entries). Refused, it changes nothing."""
        with self._starting():
            steps_done, user, _ = self._core.load_checkpoint(os.fspath(path))
        return steps_done, user

    def stats(self) -> _core.RuntimeStats:
        return self.core.stats()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the runtime's loss scale, as ``GradScaler.scale``: call ``backward()`` on
        the result inside the step. The scale stays on the device (no synchronisation); the
        runtime unscales the gradients in the update, skips a step whose gradients are not finite
        on any rank, and changes the scale at the step's end. Without ``[scaler] enabled`` the
        loss itself."""
        if not self.options.scaler.enabled:
            return loss
        if self._scale_view is None:
            self._scale_view = self.core.loss_scale_tensor().reshape(())
        return loss * self._scale_view

    def scaler_state(self) -> _core.LossScalerState:
        """The loss scaler's scale, growth tracker, skipped steps and the last step's global
        gradient norm (with ``[scaler]`` or ``[optimizer] clip``). Synchronises."""
        return self.core.scaler_state()

    @property
    def optimizer(self) -> _core.AdamW:
        """The AdamW hyperparameters (a copy); assign to change them between steps."""
        return self.core.optimizer

    @optimizer.setter
    def optimizer(self, options: _core.AdamW) -> None:
        self.core.optimizer = options

    def set_lr(self, lr: float) -> None:
        """Sets the optimizer's learning rate (each unit's is this times its lr_scale)."""
        o = self.core.optimizer
        o.lr = lr
        self.core.optimizer = o

    def agree_stop(self, local: int = 0) -> int:
        """Agrees with the other ranks whether to stop, at a step boundary (see runtime::agree_stop)."""
        return self.core.agree_stop(local)

    def _expect_between_steps(self, what: str) -> None:
        if self._scope is not None:
            raise _core.InvalidArgument(f"taskswap: {what} inside a step scope; call it between steps")
