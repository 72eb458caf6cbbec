"""MLflow: the job process logs each job as a child run of its sweep's parent run (`runs`), re-logs what a
store missed (`sync`), and attaches the sweep report (`upload`); `sources` reads runs back for a report."""
