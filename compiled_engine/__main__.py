from compiled_engine.cli import main

raise SystemExit(main())
