"""The one error type raised for any checkpoint that cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint (directory or GGUF file) is unsupported or broken.

    The message names the offending file and, where there is one, the tensor or config
    key, on one line of at most a few hundred characters, e.g. ``model.safetensors: tensor
    'lm_head.weight' has shape [10, 64], expected [300, 64]``.
    """

    MAX_DETAIL = 400   # a corrupt file's strings (key names, token text) can be huge

    def __init__(self, path, detail):
        self.path = str(path)
        # one line, whatever the underlying reader's message held
        detail = ' '.join(str(detail).split())
        if len(detail) > self.MAX_DETAIL:
            detail = detail[:self.MAX_DETAIL - 3] + '...'
        self.detail = detail
        super().__init__(f'{self.path}: {detail}')

    def __reduce__(self):   # intact across processes (rt-llm-eval's workers, Ray tasks)
        return type(self), (self.path, self.detail)
