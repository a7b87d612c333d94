//! Human-readable output: aligned text tables and number formatting.

use std::fmt::Write as _;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A text table: a header row and data rows, columns padded to their
/// widest cell, two spaces apart. Numbers read best right-aligned.
#[derive(Debug)]
pub struct Table {
    headers: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[(&str, Align)]) -> Self {
        Self::with_columns(headers.iter().map(|(h, a)| (h.to_string(), *a)).collect())
    }

    /// A table whose columns are only known at run time (`stats`).
    pub fn with_columns(headers: Vec<(String, Align)>) -> Self {
        Self {
            headers,
            rows: Vec::new(),
        }
    }

    /// The same table with more columns at the end (before any row).
    pub fn with_more(mut self, headers: &[(&str, Align)]) -> Self {
        debug_assert!(self.rows.is_empty());
        self.headers
            .extend(headers.iter().map(|(h, a)| (h.to_string(), *a)));
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        render(&self.headers, &self.rows)
    }
}

fn render(headers: &[(String, Align)], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header_cells: Vec<String> = headers.iter().map(|(h, _)| h.clone()).collect();
    for row in std::iter::once(&header_cells).chain(rows) {
        let mut line = String::new();
        for (i, ((cell, w), (_, align))) in row.iter().zip(&widths).zip(headers).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = w.saturating_sub(cell.chars().count());
            match align {
                Align::Left => {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                }
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// A percentage with two decimals ("33.33%").
pub fn pct(v: f64) -> String {
    format!("{v:.2}%")
}

/// A byte count in binary units ("1.5 KiB"); exact below 1 KiB.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A duration in nanoseconds, in its largest whole unit and the next
/// ("2h03m", "45.2s", "120ms").
pub fn duration_ns(ns: u64) -> String {
    let s = ns / 1_000_000_000;
    if s >= 86_400 {
        format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600)
    } else if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s >= 1 {
        format!("{:.1}s", ns as f64 / 1e9)
    } else {
        format!("{}ms", ns / 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let mut t = Table::new(&[("NAME", Align::Left), ("N", Align::Right)]);
        t.row(vec!["a".into(), "1000".into()]);
        t.row(vec!["longer".into(), "7".into()]);
        assert_eq!(
            t.render(),
            "NAME       N\n\
             a       1000\n\
             longer     7\n"
        );
    }

    #[test]
    fn trailing_spaces_are_trimmed() {
        let mut t = Table::new(&[("A", Align::Left), ("B", Align::Left)]);
        t.row(vec!["xxxx".into(), "".into()]);
        assert_eq!(t.render(), "A     B\nxxxx\n");
    }

    #[test]
    fn run_time_columns() {
        let mut t = Table::with_columns(vec![("X".into(), Align::Right)]);
        t.row(vec!["12".into()]);
        assert_eq!(t.render(), " X\n12\n");
    }

    #[test]
    fn number_formats() {
        assert_eq!(pct(100.0 / 3.0), "33.33%");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
        assert_eq!(duration_ns(120_000_000), "120ms");
        assert_eq!(duration_ns(45_200_000_000), "45.2s");
        assert_eq!(duration_ns(125 * 1_000_000_000), "2m05s");
        assert_eq!(duration_ns(7380 * 1_000_000_000), "2h03m");
        assert_eq!(duration_ns(90_000 * 1_000_000_000), "1d01h");
    }
}
