"""Long-context accuracy suite: offline tasks, policy sweeps, layer calibration (`kvsparse eval`,
`kvsparse calibrate`)."""
