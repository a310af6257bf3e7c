//! A span's fields as a JSON object, written straight into the span's
//! string: what `tracing_subscriber`'s `JsonFields` writes, without its
//! map of `serde_json::Value`s and the allocation per field.
//!
//! Every operation makes two spans (`submit operation`, `run operation`)
//! whose fields are rendered when the span is made, whether or not a line
//! is ever logged inside it: with `JsonFields` that rendering was the
//! larger part of the spans' cost on the hot path. The JSON event
//! formatter reads the string back (`"span": {...}` of a line) as JSON, so
//! the output must be a valid JSON object with the same values; the tests
//! compare the two formatters field by field.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, FormattedFields};

/// The JSON logs' span field formatter (`--log-format json`).
#[derive(Debug, Default, Clone, Copy)]
pub struct SpanJsonFields;

impl<'w> FormatFields<'w> for SpanJsonFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut object = Object {
            out: &mut writer,
            empty: true,
            result: Ok(()),
        };
        object.result = object.out.write_char('{');
        fields.record(&mut object);
        object.result?;
        writer.write_char('}')
    }

    /// Fields recorded after the span was made (a replayed key's join):
    /// merged into the object already written, a later value replacing an
    /// earlier one of the same name. Rare, so it parses and re-serializes.
    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut added = String::new();
        self.format_fields(Writer::new(&mut added), fields)?;
        if current.fields.is_empty() {
            current.fields = added;
            return Ok(());
        }
        let mut merged: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&current.fields).map_err(|_| fmt::Error)?;
        let added: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&added).map_err(|_| fmt::Error)?;
        merged.extend(added);
        current.fields = serde_json::Value::Object(merged).to_string();
        Ok(())
    }
}

/// Writes `"name":value` pairs; the first error stops the writing.
struct Object<'a, 'w> {
    out: &'a mut Writer<'w>,
    empty: bool,
    result: fmt::Result,
}

impl Object<'_, '_> {
    /// `,"name":` (a raw identifier's `r#` dropped, as `JsonFields` does),
    /// or nothing when an error was met or the field is the `log` crate's
    /// metadata, which `JsonFields` leaves out too.
    fn key(&mut self, field: &Field) -> bool {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return false;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        let separator = if self.empty { "\"" } else { ",\"" };
        self.empty = false;
        // Plain `write_str`s: `write!` costs more than the rest of a field.
        self.result = self
            .out
            .write_str(separator)
            .and_then(|()| Escaped(self.out).write_str(name))
            .and_then(|()| self.out.write_str("\":"));
        self.result.is_ok()
    }

    fn string(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.key(field) {
            self.result = self
                .out
                .write_char('"')
                .and_then(|()| write!(Escaped(self.out), "{value:?}"))
                .and_then(|()| self.out.write_char('"'));
        }
    }

    fn raw(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if self.key(field) {
            self.result = self.out.write_fmt(value);
        }
    }
}

impl Visit for Object<'_, '_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.string(field, value);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if self.key(field) {
            self.result = self
                .out
                .write_char('"')
                .and_then(|()| Escaped(self.out).write_str(value))
                .and_then(|()| self.out.write_char('"'));
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.raw(field, format_args!("{value}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.raw(field, format_args!("{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.raw(field, format_args!("{value}"));
    }

    /// As `serde_json` writes it (`1.0`, `null` for NaN and infinities).
    fn record_f64(&mut self, field: &Field, value: f64) {
        let json = serde_json::Value::from(value);
        self.raw(field, format_args!("{json}"));
    }

    /// An array of numbers, as `JsonFields` writes bytes.
    fn record_bytes(&mut self, field: &Field, value: &[u8]) {
        let json = serde_json::Value::from(value);
        self.raw(field, format_args!("{json}"));
    }
}

/// Escapes what passes through as the inside of a JSON string: quote,
/// backslash and control characters, as `serde_json` does.
struct Escaped<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for Escaped<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
            return self.0.write_str(s);
        }
        let mut plain = 0;
        for (i, b) in s.bytes().enumerate() {
            let escape = match b {
                b'"' => "\\\"",
                b'\\' => "\\\\",
                b'\n' => "\\n",
                b'\r' => "\\r",
                b'\t' => "\\t",
                0x08 => "\\b",
                0x0c => "\\f",
                0x00..=0x1f => "",
                _ => continue,
            };
            self.0.write_str(&s[plain..i])?;
            if escape.is_empty() {
                write!(self.0, "\\u{b:04x}")?;
            } else {
                self.0.write_str(escape)?;
            }
            plain = i + 1;
        }
        self.0.write_str(&s[plain..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::format::JsonFields;
    use tracing_subscriber::layer::SubscriberExt as _;

    /// A writer the tests read back: every line logged.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lines").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Lines {
        fn json(&self) -> Vec<serde_json::Value> {
            let bytes = self.0.lock().expect("lines").clone();
            String::from_utf8(bytes)
                .expect("utf-8")
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect()
        }
    }

    /// The same spans and events logged through the JSON formatter with
    /// `fields` as its span field formatter: the lines, as JSON.
    fn logged<N>(fields: N) -> Vec<serde_json::Value>
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let lines = Lines::default();
        let out = lines.clone();
        let layer = tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .fmt_fields(fields)
            .without_time()
            .with_writer(move || out.clone());
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let id = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
            let odd = "quote \" backslash \\ newline \n tab \t bell \u{7} nul \0 é ✓ \u{1f600}";
            let r#type = "raw";
            let span = tracing::info_span!(
                "run operation",
                operation_id = %id,
                action = "attach",
                odd,
                debugged = ?vec!["a\"b", "c"],
                negative = -42i64,
                count = 7u64,
                big = u128::MAX,
                yes = true,
                ratio = 1.0f64,
                nan = f64::NAN,
                r#type,
                later = tracing::field::Empty,
                replaced = tracing::field::Empty,
            );
            span.in_scope(|| tracing::info!(n = 1, "inside"));
            span.record("later", tracing::field::display("then"));
            span.in_scope(|| tracing::info!(n = 2, "after a record"));
            span.record("later", 5u64);
            span.record("replaced", "x");
            span.in_scope(|| tracing::info!(n = 3, "after two more"));
            let empty = tracing::info_span!("empty", late = tracing::field::Empty);
            empty.in_scope(|| tracing::info!(n = 4, "in an empty span"));
            empty.record("late", "recorded");
            empty.in_scope(|| tracing::info!(n = 5, "in a span recorded after"));
        });
        lines.json()
    }

    #[test]
    fn span_fields_read_back_as_tracing_subscribers_own_json_fields() {
        let ours = logged(SpanJsonFields);
        let theirs = logged(JsonFields::default());
        assert_eq!(ours.len(), 5);
        assert_eq!(ours, theirs);
        // Not vacuous: the spans' fields are there, escaped and typed.
        let span = &ours[0]["span"];
        assert_eq!(span["name"], "run operation");
        assert_eq!(span["operation_id"], "01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(
            span["odd"],
            "quote \" backslash \\ newline \n tab \t bell \u{7} nul \0 é ✓ \u{1f600}"
        );
        assert_eq!(span["negative"], -42);
        assert_eq!(span["yes"], true);
        assert_eq!(span["type"], "raw");
        assert!(span["nan"].is_null(), "{span}");
        assert_eq!(ours[1]["span"]["later"], "then");
        assert_eq!(ours[2]["span"]["later"], 5);
        assert_eq!(ours[2]["span"]["replaced"], "x");
        assert!(ours[3]["span"].get("late").is_none(), "{}", ours[3]);
        assert_eq!(ours[4]["span"]["late"], "recorded");
    }
}
