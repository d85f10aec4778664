"""Subcommands of ``omnibal-compile``; registered in :data:`omnibal_compile.cli.COMMANDS`."""
