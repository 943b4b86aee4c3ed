from fxacct_cli.main import main

if __name__ == "__main__":  # not again in a spawned worker (fxacct plan --jobs), which imports it as __mp_main__
    main()
