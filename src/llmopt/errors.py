"""The one error type users see: a problem and its fix, printable on one line."""


class LlmoptError(Exception):
    """A user-facing failure. `fix` tells the user what to do about it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} -- {fix}" if fix else problem)

    def one_line(self) -> str:
        return " ".join(str(self).split())
