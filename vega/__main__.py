from vega.cli import main

raise SystemExit(main())
