"""Training: ``train(config, hyp)`` coordinates; loop.py runs epochs and steps."""


def train(config, hyp, callbacks=None):
    from utils.trainer.trainer import train as _train

    return _train(config, hyp, callbacks)
