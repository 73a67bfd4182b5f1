/** Pieces every section of the sidebar uses. */

import * as React from 'react';

export function Section(props: {
  title: string;
  name: string;
  count?: number;
  countLabel?: string;
  /** What the badge says, when a bare number would not say what it counts. */
  countText?: string;
  error?: string | null;
  children?: React.ReactNode;
}): React.ReactElement {
  return (
    <section className={`jp-LMSP-section jp-LMSP-${props.name}`} data-section={props.name}>
      <h3 className="jp-LMSP-sectionTitle">
        {props.title}
        {props.count !== undefined ? (
          <span
            className={`jp-LMSP-count${props.count > 0 ? ' jp-mod-nonzero' : ''}`}
            title={props.countLabel}
          >
            {props.countText ?? props.count}
          </span>
        ) : null}
      </h3>
      {props.error ? <ErrorLine text={props.error} /> : null}
      {props.children}
    </section>
  );
}

export function ErrorLine(props: { text: string }): React.ReactElement {
  return (
    <div className="jp-LMSP-error" role="alert">
      {props.text}
    </div>
  );
}

export function Empty(props: { text: string }): React.ReactElement {
  return <div className="jp-LMSP-empty">{props.text}</div>;
}

export function Button(props: {
  label: string;
  title?: string;
  onClick: () => void;
  disabled?: boolean;
  kind?: 'accept' | 'warn' | 'plain';
  name: string;
}): React.ReactElement {
  const kind = props.kind ?? 'plain';
  return (
    <button
      type="button"
      className={`jp-LMSP-button jp-LMSP-button-${kind}`}
      data-action={props.name}
      title={props.title ?? props.label}
      disabled={props.disabled}
      onClick={props.onClick}
    >
      {props.label}
    </button>
  );
}

/** A state word with a color class (`jp-LMSP-state-running`, …). */
export function StateBadge(props: { state: string }): React.ReactElement {
  return (
    <span className={`jp-LMSP-state jp-LMSP-state-${props.state}`} data-state={props.state}>
      {props.state}
    </span>
  );
}
