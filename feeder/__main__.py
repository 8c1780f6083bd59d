"""``python -m feeder``: the ``feeder`` command (:mod:`cli.app`) under the project's
name. Never imported, only run, so it may name the layer above every package."""

from cli.app import main

main()
