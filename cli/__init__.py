"""The ``feeder`` command line (:mod:`cli.app`, on top of every package's
``commands.py``) and ``make demo`` (:mod:`cli.demo`): the top layer, above the
sharder, the daemon, the launcher and the trainer, whose commands it gathers."""
