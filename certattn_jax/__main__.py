from certattn_jax.cli import main

raise SystemExit(main())
