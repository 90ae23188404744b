"""LoadgenError: a user-facing failure, printed as one line without a traceback."""


class LoadgenError(Exception):
    pass
