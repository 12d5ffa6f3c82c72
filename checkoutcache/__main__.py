from checkoutcache.cli.commands import main

main()
