"""The errors a user's input raises (a file, a directory, a config value), below every layer so that any may raise
them; `m2flow.config` re-exports them. The `m2flow` command prints one as one line and exits with code 2."""


class UserError(ValueError):
    """Something the user gave is wrong or in the way (a file, a directory, a value): the message names it, says what
    was expected and how to go on. The `m2flow` command prints it as one line and exits with code 2."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named is missing or is not what was expected (also a FileNotFoundError)."""


class ConfigError(UserError):
    """A config value or key is wrong; the message names the dotted field and what was expected."""
