from fxacct_cli.main import main

main()
