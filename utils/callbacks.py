"""Training and validation hooks: YOLOv5's ``Callbacks`` registry, under its module name and with its methods.

A script written for YOLOv5 registers its functions and hands the registry to training::

    from utils.callbacks import Callbacks
    callbacks = Callbacks()
    callbacks.register_action("on_fit_epoch_end", name="log", callback=lambda vals, epoch, best_fitness, fi: ...)
    train.run(data="data.yaml", callbacks=callbacks)        # or train.main(train.parse_opt(), callbacks)

Each YOLOv5 hook is called where YOLOv5 v7.0 calls it, with its arguments in its order (``HOOKS`` lists them),
on the processes YOLOv5 calls it on: every process for the ``*_start`` hooks of training, the main process for the
rest. Validation's hooks run where validation runs (under torchrun every process validates its share of the val
set: ``on_val_image_end`` and ``on_val_batch_end`` see that share; ``on_val_end`` the whole set's figures, on the
main process). YOLOv5 lists four hooks it never calls; here they are called too: ``optimizer_step`` after each
optimizer step and ``on_before_zero_grad`` just before its gradients are cleared, ``on_params_update({"batch_size":
n})`` when AutoBatch chooses the batch size, ``teardown`` when training ends, however it ends. Setting
``callbacks.stop_training = True`` ends the run at the next optimizer step (every process at the same one): last.pt
holds that position, so ``--resume`` continues it, and training returns without the final validation.

``on_epoch_stats`` is this project's own hook, called with keywords: ``epoch``, ``values`` (the results.csv row as
a dict), ``fitness`` and ``stats`` (the epoch's timings, utils/trainer/loop.py's EpochStats), on every process.

A hook with no action costs one dictionary lookup: the training loop asks ``has(hook)`` once per epoch.
"""
from __future__ import annotations

import threading
from typing import Callable

HOOKS = {  # hook: its arguments, as called
    "on_pretrain_routine_start": "()",
    "on_pretrain_routine_end": "(labels, names): every training box (n, 5) class cx cy w h normalised; {i: name}",
    "on_train_start": "()",
    "on_train_epoch_start": "()",
    "on_train_batch_start": "()",
    "optimizer_step": "()",
    "on_before_zero_grad": "()",
    "on_train_batch_end": "(model, ni, imgs, targets, paths, vals): vals = the epoch's mean box, obj, cls losses",
    "on_train_epoch_end": "(epoch=epoch)",
    "on_val_start": "()",
    "on_val_batch_start": "()",
    "on_val_image_end": "(pred, predn, path, names, im): pred in the model's input pixels, predn in the image's",
    "on_val_batch_end": "(batch_i, im, targets, paths, shapes, preds)",
    "on_val_end": "(nt, tp, fp, p, r, f1, ap, ap50, ap_class, confusion_matrix)",
    "on_fit_epoch_end": "(log_vals, epoch, best_fitness, fi): log_vals = results.csv's 13 values in its order",
    "on_model_save": "(last, epoch, final_epoch, best_fitness, fi)",
    "on_train_end": "(last, best, epoch, results)",
    "on_params_update": "(params): a dict",
    "teardown": "()",
    "on_epoch_stats": "(*, epoch, values, fitness, stats): this project's own",
}


class Callbacks:
    """Actions registered per hook, run in the order registered."""

    def __init__(self):
        self._callbacks: dict[str, list[dict]] = {hook: [] for hook in HOOKS}
        self.stop_training = False  # set by an action: the run ends at the next optimizer step

    def register_action(self, hook: str, name: str = "", callback: Callable | None = None) -> None:
        """Add ``callback`` to ``hook``'s actions, under ``name`` (YOLOv5's signature)."""
        if hook not in self._callbacks:
            raise ValueError(f"unknown callback hook '{hook}' (known: {', '.join(HOOKS)})")
        if not callable(callback):
            raise ValueError(f"callback for hook '{hook}' is not callable: {callback!r}")
        self._callbacks[hook].append({"name": name, "callback": callback})

    def get_registered_actions(self, hook: str | None = None):
        """``hook``'s actions as ``[{"name": ..., "callback": ...}]``, or every hook's when None."""
        return self._callbacks[hook] if hook else self._callbacks

    def has(self, hook: str) -> bool:
        return bool(self._callbacks.get(hook))

    def run(self, hook: str, *args, thread: bool = False, **kwargs) -> None:
        """Call ``hook``'s actions with these arguments; ``thread``: each in a daemon thread, not waited for."""
        if hook not in self._callbacks:
            raise ValueError(f"unknown callback hook '{hook}' (known: {', '.join(HOOKS)})")
        for action in self._callbacks[hook]:
            if thread:
                threading.Thread(target=action["callback"], args=args, kwargs=kwargs, daemon=True).start()
            else:
                action["callback"](*args, **kwargs)
