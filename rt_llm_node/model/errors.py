"""The one error type raised for any checkpoint that cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint directory is unsupported or broken.

    The message always names the offending file and, where there is one, the
    tensor or config key, e.g. ``model.safetensors: tensor 'lm_head.weight' has
    shape [10, 64], expected [300, 64]``.
    """

    def __init__(self, path, detail):
        self.path = str(path)
        self.detail = detail
        super().__init__(f'{self.path}: {detail}')
