"""One rich console for the whole package, so progress bars and messages do not fight."""

from rich.console import Console

console = Console(stderr=True)
