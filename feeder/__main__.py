from feeder.cli import main

main()
