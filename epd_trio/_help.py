"""The ``epd-trio`` commands' help: a short page first, one option group or every option on request.

``epd-trio encoder --help`` shows the options most runs need, the option groups and examples;
``--help=GROUP`` one group (``--help=delivery``), ``--help=all`` every option, ``--help=WORD``
the options whose names contain WORD (``--help=timeout``). The groups are the config fields'
(``epd_trio._options.GROUPS``), so a new field shows up in its group with nothing to add here.
argparse has no public way to walk its groups; ``_action_groups`` and ``_group_actions`` are
the attributes its own ``format_help`` reads.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["CommandParser", "HelpFormatter"]

_NOT_OPTION_GROUPS = ("positional arguments", "options")


class HelpFormatter(argparse.HelpFormatter):
    """Paragraphs are wrapped to the terminal, never inside a --flag-name; one with an indented
    line (examples, a table) is kept as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _TopicHelp):
            return "-h, --help[=TOPIC]"
        return super()._format_action_invocation(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if any(line.startswith(" ") for line in paragraph.splitlines()):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent,
                                                subsequent_indent=indent, break_on_hyphens=False))
        return "\n\n".join(paragraphs)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class CommandParser(argparse.ArgumentParser):
    """A bad flag is one line, as every other start-up error is (not the whole usage).

    With ``brief`` (the destinations of the options most runs need, in the order shown),
    ``--help`` is a short page and ``--help=TOPIC`` shows one group, every option or a search.
    """

    def __init__(self, *args: Any, brief: Sequence[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if brief is not None:
            kwargs["add_help"] = False
            kwargs.setdefault("usage", "%(prog)s [options]")
        super().__init__(*args, **kwargs)
        self.brief = tuple(brief) if brief is not None else None
        if brief is not None:
            self.add_argument("-h", "--help", nargs="?", const="", default=argparse.SUPPRESS,
                              metavar="TOPIC", action=_TopicHelp,
                              help="this page; --help=GROUP: one option group; --help=all: every "
                                   "option; --help=WORD: the options whose names contain WORD")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        return super().format_help() if self.brief is None else self.format_topic("")

    def format_topic(self, topic: str) -> str:
        """The help on ``topic``: "" the short page, ``all``, a group's title, or a word."""
        if topic == "":
            return self._short_page()
        if topic.lower() == "all":
            return super().format_help()
        for group in self._option_groups():
            if group.title == topic.lower():
                return self._section(group.title, group.description, group._group_actions)
        word = topic.lower().removeprefix("epd_").replace("_", "-").strip("-")
        found = [action for action in self._actions
                 if word and any(word in option for option in action.option_strings)]
        if not found:
            self.error(f"no option group or option matches {topic!r}; the groups: "
                       f"{', '.join(str(g.title) for g in self._option_groups())}")
        return self._section(f"options matching {topic!r}", None, found)

    def _option_groups(self) -> list[Any]:
        return [group for group in self._action_groups
                if group._group_actions and group.title not in _NOT_OPTION_GROUPS]

    def _section(self, title: str | None, text: str | None, actions: list[argparse.Action]) -> str:
        formatter = self._get_formatter()
        formatter.start_section(title)
        formatter.add_text(text)
        formatter.add_arguments(actions)
        formatter.end_section()
        return formatter.format_help()

    def _short_page(self) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        by_dest = {action.dest: action for action in self._actions}
        formatter.start_section("options most runs need")
        formatter.add_arguments([by_dest["help"], *(by_dest[dest] for dest in self.brief or ())])
        formatter.end_section()
        formatter.add_text("option groups (--help=GROUP shows one, --help=all every option):\n"
                           + self._group_table(formatter))
        formatter.add_text(self.epilog)
        return formatter.format_help()

    def _group_table(self, formatter: argparse.HelpFormatter) -> str:
        """One line per group: its title and what it holds (indented: kept as written)."""
        groups = self._option_groups()
        name_width = max(len(str(group.title)) for group in groups) + 2
        width = max(formatter._width - name_width - 2, 30)
        lines = []
        for group in groups:
            wrapped = textwrap.wrap(group.description or "", width) or [""]
            lines.append(f"  {group.title!s:<{name_width}}{wrapped[0]}")
            lines += ["  " + " " * name_width + line for line in wrapped[1:]]
        return "\n".join(lines)


class _TopicHelp(argparse.Action):
    """``-h``/``--help`` with an optional topic: print that help and exit 0."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        assert isinstance(parser, CommandParser)
        sys.stdout.write(parser.format_topic(values or ""))
        parser.exit()
