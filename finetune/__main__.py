from finetune.cli import main

raise SystemExit(main())
