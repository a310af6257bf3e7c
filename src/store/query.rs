//! The list query (`Store::operation_list`), built in one place for both
//! stores: its SQL and its arguments together, each argument pushed as
//! its placeholder is written, so no store keeps a bind order by hand.
//! A new filter is a field of [`OperationFilter`] and a line here.
//!
//! Only the conditions a filter sets are written: under the connections'
//! generic plans a condition written `($1 IS NULL OR server_id = $1)` can
//! use no index, and every listing read the whole table (measured: a
//! sequential scan and a sort at 50,000 rows). Each documented filter and
//! order has an index that serves it (`pg::tooling::index_queries`,
//! `sqlite::index_queries`, and the plan tests in `tests/store`).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::rows::{COLUMNS, OPEN};
use super::{ListCursor, OperationFilter};
use crate::domain::Labels;

/// Which database the statement is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Postgres,
    Sqlite,
}

/// One argument of a built statement, as the domain has it; each store
/// binds it in its own column type (SQLite: ids as text, times as
/// microseconds, JSON as text).
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    Text(String),
    Uuid(Uuid),
    Int(i64),
    Time(DateTime<Utc>),
    /// Labels as a JSON object (PostgreSQL's `@>`).
    Labels(Labels),
}

/// A statement and its arguments, in the order of its placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub sql: String,
    pub args: Vec<Arg>,
}

/// Conditions and their arguments as they are written.
struct Where {
    dialect: Dialect,
    conds: Vec<String>,
    args: Vec<Arg>,
}

impl Where {
    /// The next placeholder, for `arg`.
    fn param(&mut self, arg: Arg) -> String {
        self.args.push(arg);
        match self.dialect {
            Dialect::Postgres => format!("${}", self.args.len()),
            Dialect::Sqlite => format!("?{}", self.args.len()),
        }
    }

    /// A condition on one argument: `{}` in `cond` is its placeholder.
    fn on(&mut self, cond: &str, arg: Arg) {
        let p = self.param(arg);
        self.conds.push(cond.replace("{}", &p));
    }

    fn plain(&mut self, cond: &str) {
        self.conds.push(cond.to_string());
    }
}

impl std::fmt::Display for OperationFilter {
    /// What it asks for, as `ops list` flags read (a bulk call's audit):
    /// `state=unknown label=k=v created>=…`; `everything` for none.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(s) = self.state {
            parts.push(format!("state={}", s.as_str()));
        }
        if let Some(s) = self.server_id {
            parts.push(format!("server_id={s}"));
        }
        if let Some(v) = self.volume_id {
            parts.push(format!("volume_id={v}"));
        }
        if let Some(c) = &self.caller {
            parts.push(format!("caller={c}"));
        }
        if self.drifted_only {
            parts.push("drifted".into());
        }
        if self.escalated_only {
            parts.push("escalated".into());
        }
        parts.extend(self.labels.iter().map(|(k, v)| format!("label={k}={v}")));
        let times = [
            ("created>=", self.created.from),
            ("created<", self.created.before),
            ("updated>=", self.updated.from),
            ("updated<", self.updated.before),
        ];
        for (what, t) in times {
            if let Some(t) = t {
                parts.push(format!("{what}{}", t.to_rfc3339()));
            }
        }
        if parts.is_empty() {
            f.write_str("everything")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

/// The page of `filter` after `after`, newest first, `limit` rows and one
/// more (it says more follow). Ordered and paged by `seq`, which never
/// changes: a row that changes while a list is paged appears at most
/// once, and none is skipped.
///
/// Time ranges are conditions on the walk by `seq` (newest first): a page
/// of a range that reaches the present reads about a page; one that ended
/// long ago first passes over what was created since. An index of
/// `created_at` would serve old ranges, at two more index entries per
/// operation on the write path (measured: 21.4 WAL records per attach
/// against 18.3, `tests/whole_cluster/ledger_cost.rs`), and one of
/// `updated_at` would cost every decision a heap-only update.
pub fn list(
    filter: &OperationFilter,
    after: Option<ListCursor>,
    limit: u32,
    dialect: Dialect,
) -> Built {
    let mut w = Where {
        dialect,
        conds: Vec::new(),
        args: Vec::new(),
    };
    if let Some(id) = filter.id {
        w.on("id = {}", Arg::Uuid(id));
    }
    if let Some(state) = filter.state {
        w.on("state = {}", Arg::Text(state.as_str().into()));
        if !state.is_terminal() {
            // Also said this way: the open operations' partial index.
            w.plain(OPEN);
        }
    }
    if filter.open_only && filter.state.is_none() {
        w.plain(OPEN);
    }
    if let Some(server) = filter.server_id {
        w.on("server_id = {}", Arg::Uuid(server));
    }
    if let Some(volume) = filter.volume_id {
        w.on("volume_id = {}", Arg::Uuid(volume));
    }
    if let Some(caller) = &filter.caller {
        w.on(
            "COALESCE(caller, '') = {}",
            Arg::Text(caller.as_str().into()),
        );
    }
    if filter.drifted_only {
        w.plain("drifted");
    }
    if filter.escalated_only {
        w.plain("escalated_at IS NOT NULL");
    }
    // PostgreSQL walks a label's entries newest first (`operation_labels`);
    // SQLite checks labels on its walk.
    let driven = match (dialect, filter.labels.iter().next()) {
        (Dialect::Postgres, Some((k, v))) => {
            w.on("l.key = {}", Arg::Text(k.into()));
            w.on("l.value = {}", Arg::Text(v.into()));
            let rest = Labels::from_stored(
                filter
                    .labels
                    .iter()
                    .skip(1)
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            );
            labels(&mut w, &rest);
            true
        }
        _ => {
            labels(&mut w, &filter.labels);
            false
        }
    };
    let (created, updated) = (&filter.created, &filter.updated);
    if let Some(t) = created.from {
        w.on("created_at >= {}", Arg::Time(t));
    }
    if let Some(t) = created.before {
        w.on("created_at < {}", Arg::Time(t));
    }
    if let Some(t) = updated.from {
        w.on("updated_at >= {}", Arg::Time(t));
    }
    if let Some(t) = updated.before {
        w.on("updated_at < {}", Arg::Time(t));
    }
    if let Some(c) = after {
        if driven {
            w.on("l.op_seq < {}", Arg::Int(c.seq));
        } else {
            w.on("seq < {}", Arg::Int(c.seq));
        }
    }
    let order = if driven { "l.op_seq DESC" } else { "seq DESC" };
    let from = match dialect {
        Dialect::Postgres if driven => {
            "operation_labels l JOIN operations ON operations.seq = l.op_seq"
        }
        // SQLite's planner would rather walk the whole table backwards by
        // `seq` than scan a partial index and sort the few rows it holds.
        Dialect::Sqlite
            if filter.state.is_some_and(|s| !s.is_terminal())
                && filter.server_id.is_none()
                && filter.id.is_none()
                && filter.labels.is_empty() =>
        {
            "operations INDEXED BY operations_open"
        }
        _ => "operations",
    };
    Built {
        sql: format!(
            "SELECT {COLUMNS}, seq FROM {from} {where_} ORDER BY {order} LIMIT {limit}",
            where_ = if w.conds.is_empty() {
                String::new()
            } else {
                format!("WHERE {}", w.conds.join(" AND "))
            },
            // A number, not a parameter: a generic plan with LIMIT $n
            // cannot tell a page from the whole table.
            limit = u64::from(limit) + 1,
        ),
        args: w.args,
    }
}

/// Every label of `wanted` on the row, as a condition (no index): the
/// labels after the one PostgreSQL walks; SQLite's JSON pairs.
fn labels(w: &mut Where, wanted: &Labels) {
    if wanted.is_empty() {
        return;
    }
    match w.dialect {
        Dialect::Postgres => w.on("labels @> {}::jsonb", Arg::Labels(wanted.clone())),
        Dialect::Sqlite => {
            for (k, v) in wanted.iter() {
                let key = w.param(Arg::Text(k.into()));
                let value = w.param(Arg::Text(v.into()));
                w.conds.push(format!(
                    "EXISTS (SELECT 1 FROM json_each(operations.labels) l WHERE l.key = {key} AND l.value = {value})"
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Caller, State};
    use crate::store::TimeRange;

    /// Each placeholder has its argument, in order, whatever is set.
    #[test]
    fn placeholders_and_arguments_go_together() {
        let t = Utc::now();
        let f = OperationFilter {
            state: Some(State::Unknown),
            server_id: Some(Uuid::nil()),
            caller: Some(Caller::ANONYMOUS),
            labels: Labels::parse("labels", [("a", "1"), ("b", "2")]).unwrap(),
            created: TimeRange {
                from: Some(t),
                before: None,
            },
            updated: TimeRange {
                from: None,
                before: Some(t),
            },
            ..Default::default()
        };
        let cursor = ListCursor { seq: 7 };
        for (dialect, mark) in [(Dialect::Postgres, '$'), (Dialect::Sqlite, '?')] {
            let b = list(&f, Some(cursor), 50, dialect);
            let n = b.sql.matches(mark).count();
            assert_eq!(n, b.args.len(), "{dialect:?}: {}", b.sql);
            for i in 1..=n {
                assert!(b.sql.contains(&format!("{mark}{i}")), "{}", b.sql);
            }
            assert!(b.sql.contains("LIMIT 51"), "{}", b.sql);
        }
        // PostgreSQL walks the first label's entries, newest first, and
        // checks the others.
        let pg = list(&f, Some(cursor), 50, Dialect::Postgres);
        assert!(
            pg.sql.contains("FROM operation_labels l JOIN operations"),
            "{}",
            pg.sql
        );
        assert!(pg.sql.contains("ORDER BY l.op_seq DESC"), "{}", pg.sql);
        assert_eq!(
            pg.args,
            [
                Arg::Text("unknown".into()),
                Arg::Uuid(Uuid::nil()),
                Arg::Text(String::new()),
                Arg::Text("a".into()),
                Arg::Text("1".into()),
                Arg::Labels(Labels::parse("labels", [("b", "2")]).unwrap()),
                Arg::Time(t),
                Arg::Time(t),
                Arg::Int(7),
            ]
        );
        let sqlite = list(&f, None, 50, Dialect::Sqlite);
        assert_eq!(sqlite.args.len(), 9, "two per label: {:?}", sqlite.args);
    }

    #[test]
    fn pages_go_by_seq() {
        let b = list(
            &OperationFilter::default(),
            Some(ListCursor { seq: 9 }),
            10,
            Dialect::Postgres,
        );
        assert!(
            b.sql.ends_with("WHERE seq < $1 ORDER BY seq DESC LIMIT 11"),
            "{}",
            b.sql
        );
        assert_eq!(b.args, [Arg::Int(9)]);
    }
}
