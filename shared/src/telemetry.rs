//! What the worker's and the orchestrator's metrics have in common.

/// Histogram buckets for every latency (`*_seconds`), 5 ms to 60 s, so dashboards can compare
/// the orchestrator's and the workers' figures bucket for bucket.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The standard Prometheus process metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, …) for the calling process, read from `/proc/self` at
/// scrape time, in the text exposition format; append it to a `/metrics` body. Empty where
/// `/proc` is not readable (not Linux), so `/metrics` still answers.
pub fn process_metrics() -> String {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return String::new();
    };
    let Some(p) = ProcStat::parse(&stat) else {
        return String::new();
    };
    let boot_time = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| parse_boot_time(&s));
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .ok();
    render_process(&p, boot_time, open_fds)
}

/// Linux reports CPU time and start time in clock ticks of this size (`USER_HZ`, fixed at 100
/// by the kernel's user-space ABI), and resident memory in pages (4 KiB on x86-64, the only
/// target Hearth's images are built for).
const TICKS_PER_SECOND: f64 = 100.0;
const PAGE_SIZE: u64 = 4096;

/// The fields of `/proc/<pid>/stat` the process metrics use.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ProcStat {
    utime_ticks: u64,
    stime_ticks: u64,
    threads: u64,
    start_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

impl ProcStat {
    /// The command name (field 2) is in parentheses and may itself contain spaces and
    /// parentheses, so fields are counted from the last `)`.
    fn parse(stat: &str) -> Option<Self> {
        let rest = &stat[stat.rfind(')')? + 1..];
        // `rest` starts at field 3 (state): field N is at index N - 3.
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        Some(Self {
            utime_ticks: field(14)?,
            stime_ticks: field(15)?,
            threads: field(20)?,
            start_ticks: field(22)?,
            vsize_bytes: field(23)?,
            rss_pages: field(24)?,
        })
    }
}

/// `btime` of `/proc/stat`: boot time in seconds since the epoch.
fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn render_process(p: &ProcStat, boot_time: Option<u64>, open_fds: Option<u64>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    metric(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        (p.utime_ticks + p.stime_ticks) as f64 / TICKS_PER_SECOND,
    );
    metric(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        (p.rss_pages * PAGE_SIZE) as f64,
    );
    metric(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        p.vsize_bytes as f64,
    );
    metric(
        "process_threads",
        "gauge",
        "Number of OS threads in the process.",
        p.threads as f64,
    );
    if let Some(boot) = boot_time {
        metric(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            boot as f64 + p.start_ticks as f64 / TICKS_PER_SECOND,
        );
    }
    if let Some(fds) = open_fds {
        metric(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            fds as f64,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // A real line from a process whose name holds a space and a parenthesis.
    const STAT: &str = "4242 (hearth (x) w) S 1 4242 4242 0 -1 4194560 1200 0 3 0 250 75 0 0 20 0 \
                        9 0 123456 987654321 2048 18446744073709551615 1 1 0 0 0 0 0 4096 1 0 0 0 \
                        17 1 0 0 0 0 0";

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let p = ProcStat::parse(STAT).expect("parses");
        assert_eq!(
            p,
            ProcStat {
                utime_ticks: 250,
                stime_ticks: 75,
                threads: 9,
                start_ticks: 123_456,
                vsize_bytes: 987_654_321,
                rss_pages: 2048,
            }
        );
    }

    #[test]
    fn truncated_stat_is_none() {
        assert_eq!(ProcStat::parse("4242 (hearth) S 1 2 3"), None);
        assert_eq!(ProcStat::parse("no parenthesis"), None);
    }

    #[test]
    fn rendered_values_are_in_seconds_and_bytes() {
        let p = ProcStat::parse(STAT).expect("parses");
        let text = render_process(&p, Some(1_700_000_000), Some(12));
        assert!(text.contains(
            "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.25\n"
        ));
        assert!(text.contains("\nprocess_resident_memory_bytes 8388608\n"));
        assert!(text.contains("\nprocess_virtual_memory_bytes 987654321\n"));
        assert!(text.contains("\nprocess_threads 9\n"));
        assert!(text.contains("\nprocess_start_time_seconds 1700001234.56\n"));
        assert!(text.contains("\nprocess_open_fds 12\n"));
        assert_eq!(
            parse_boot_time("cpu 1 2\nbtime 1700000000\nprocesses 5\n"),
            Some(1_700_000_000)
        );
    }

    #[test]
    fn this_process_reports_memory_and_cpu() {
        let text = process_metrics();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
        };
        // A running test binary holds at least a megabyte and has spent some CPU time.
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(value("process_start_time_seconds") > 1.6e9);
        assert!(value("process_open_fds") >= 3.0);
    }
}
